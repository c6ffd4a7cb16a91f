"""The processes one conversion runs as, and how they split its inputs.

`launched_group()` is the ranks a launcher started (`composer -n N`, torchrun) or this process alone;
`share` gives each rank its inputs, the same split computed on every rank.
"""

import os
import pickle
import time
from datetime import timedelta

from convert.common import Part


class Group:
    """The processes one conversion runs as: this one alone (rank 0 of 1)."""

    rank, world = 0, 1

    def broadcast(self, obj):
        """Rank 0's `obj`, on every rank."""
        return obj

    def gather(self, obj) -> list:
        """Every rank's `obj`, in rank order, on every rank."""
        return [obj]

    def close(self) -> None:
        pass


class LaunchedGroup(Group):
    """The ranks a launcher started (`composer -n N`, torchrun: RANK, WORLD_SIZE, MASTER_ADDR and
    MASTER_PORT set), exchanging pickled objects through torch.distributed's key-value store (rank 0
    hosts it), whatever devices the conversion uses. No process group: gloo's teardown can hang once
    rank 0 has exited. The timeout is long: rank 0 waits at the end for the slowest rank."""

    def __init__(self, timeout: timedelta = timedelta(days=7)):
        import torch.distributed as dist

        self.store, self.rank, self.world = next(dist.rendezvous("env://", timeout=timeout))
        self._round = 0

    def _key(self, what: str) -> str:
        self._round += 1  # every rank makes the same calls in the same order
        return f"sd-convert/{self._round}/{what}"

    def broadcast(self, obj):
        key = self._key("broadcast")
        if self.rank == 0:
            self.store.set(key, pickle.dumps(obj))
            return obj
        return pickle.loads(self.store.get(key))

    def gather(self, obj) -> list:
        key = self._key("gather")
        self.store.set(f"{key}/{self.rank}", pickle.dumps(obj))
        return [
            obj if r == self.rank else pickle.loads(self.store.get(f"{key}/{r}")) for r in range(self.world)
        ]

    def close(self) -> None:
        """Rank 0 hosts the store, so it leaves last, once every rank has read all it needs."""
        self.store.add("sd-convert/closed", 1)
        if self.rank == 0:
            while self.store.add("sd-convert/closed", 0) < self.world:
                time.sleep(0.05)


def launched_group() -> Group:
    """A LaunchedGroup under a launcher with more than one rank, else the lone process."""
    return LaunchedGroup() if int(os.environ.get("WORLD_SIZE", "1")) > 1 else Group()


def share(todo: list[Part], rank: int, world: int) -> list[Part]:
    """This rank's inputs, in input order. Every rank computes the same split: inputs, largest first,
    go to the rank with the fewest samples so far (by turns when sizes are unknown)."""
    if world == 1:
        return todo
    if any(p.size is None for p in todo):
        return todo[rank::world]
    loads, mine = [0] * world, set()
    for part in sorted(todo, key=lambda p: -p.size):  # stable: equal sizes stay in input order
        least = loads.index(min(loads))
        loads[least] += part.size
        if least == rank:
            mine.add(part.name)
    return [p for p in todo if p.name in mine]
