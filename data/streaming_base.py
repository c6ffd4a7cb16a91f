"""The StreamingDataset our datasets build on: two fixes to mosaicml-streaming 0.13.0 (pinned).

1. Jobs that start together on one host. A new dataset finds a free shared-memory prefix by probing
   /dev/shm, then its node's local leader creates it; two jobs probing at the same moment find the
   same prefix and the second one's create fails with FileExistsError (reproduced: three processes
   building eight datasets each, 0-2 failures per process; test workers are such jobs, and so are
   users starting several single-GPU jobs on one node at once). Here each
   node's local leader holds a host-wide lock (flock on a file in /dev/shm, where the prefixes
   live) from before its ranks probe until the prefix is registered; the other ranks wait at a
   barrier until their leader holds it.

2. Iteration of a set with nothing to download. Streaming iterates an epoch with two background
   threads per DataLoader worker: one downloads shards ahead, one waits for them, and the sample
   loop polls both every 7 ms (streaming's TICK). When no stream has a remote (`local` only: a set
   on local disk or a mounted file system), the threads find every shard in place and only poll,
   which still costs the worker's one core the GIL hand-overs: 0.37-0.39 ms of a 512x384 JPEG
   sample's 2.8-3.3 ms here (bench/loader.py's data, best of 5, in and out of a DataLoader worker;
   docs/benchmarks.md). Then the sample ids come from the same call as streaming's own `__iter__`
   (`_get_work`, through compat.streaming.epoch_sample_ids: the same order, shuffle, elastic
   partition and mid-epoch resume) and each sample is read directly. A shard that is missing or
   still compressed goes through `get_item`'s own `prepare_shard` as before, in the loop instead of
   ahead of it.

3. Who holds a prefix. Streaming cannot tell a live job's registration from a killed one's, and
   processes that merely probed a prefix keep its blocks mapped (streaming's search for a free one
   keeps open what it opened), so a mapping proves nothing either. Each process that builds one of
   our datasets holds a shared flock on the prefix's owner file in /dev/shm while the dataset lives
   (`hold_prefix`); the kernel drops it when the process dies, so recipes/shm.py removes a
   registration of our folders only when nobody holds its owner file (`prefix_held`).

`__iter__` mirrors streaming 0.13's set-up steps (compat/streaming.py); tests/test_streaming_base.py
checks the order against streaming's own iteration, and the lock against concurrent processes.
"""

import contextlib
import fcntl
import os
import tempfile
import weakref
from collections.abc import Iterator
from typing import Any

import torch.distributed
from streaming import StreamingDataset

from compat.streaming import World, epoch_sample_ids, shm_prefix, stop_epoch_threads
from data.holdout import without_held

SHM_DIR = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
PREFIX_LOCK = os.path.join(SHM_DIR, "sd-recipes-streaming-prefix.lock")
OWNER_FILE = os.path.join(SHM_DIR, "sd-recipes-prefix-{:06d}.owner")  # stays, empty, when released


def _lock_file(path: str):
    """`path` opened read-only, created if missing: flock needs no write access, so another user's
    job can lock a file this one created (0644 under the usual umask)."""
    return os.fdopen(os.open(path, os.O_RDONLY | os.O_CREAT, 0o666))


def hold_prefix(prefix: int, dataset) -> None:
    """Hold a shared flock on `prefix`'s owner file while `dataset` (which registered it) lives. Each
    dataset opens its own handle: shared flocks on one file coexist, and the lock ends when the
    dataset's handle is closed or its process dies."""
    handle = _lock_file(OWNER_FILE.format(prefix))
    fcntl.flock(handle, fcntl.LOCK_SH)  # DataLoader workers forked from here hold it too
    weakref.finalize(dataset, handle.close)


def prefix_held(prefix: int) -> bool | None:
    """Whether a live process holds `prefix` through one of our datasets; None when it has no owner
    file (registered by something else: streaming alone, or a run of code before this)."""
    try:
        handle = open(OWNER_FILE.format(prefix))  # noqa: SIM115 (closed below)
    except FileNotFoundError:
        return None
    except PermissionError:  # another user's job: not ours to judge (nor to unlink)
        return True
    with handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        return False  # the lock goes with the handle


@contextlib.contextmanager
def host_lock():
    """The host-wide lock on registering streaming prefixes (and on removing them: recipes/shm.py)."""
    with _lock_file(PREFIX_LOCK) as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)  # released when closed, or when the process dies
        yield


@contextlib.contextmanager
def prefix_registration_lock():
    """Held by each node's local leader while its ranks find and register a prefix."""
    with host_lock() if World.detect().is_local_leader else contextlib.nullcontext():
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.barrier()  # the other ranks probe only once their leader holds it
        yield


class StreamingBase(StreamingDataset):
    # False: always streaming's threaded iteration (the test compares the two).
    iterate_local_directly = True
    # data.train.holdout: the sorted global sample ids every epoch leaves out (data/holdout.py), or None.
    held_out = None

    def __init__(self, **streaming_kwargs):
        with prefix_registration_lock():
            super().__init__(**streaming_kwargs)
            hold_prefix(shm_prefix(self), self)

    def resample_streams(self, epoch: int, stream_id: int | None = None):
        # Every batching method draws an epoch's sample ids here, so dropping the held-out ones here
        # keeps them out of training whatever the batching, shuffle or resume point.
        units, ids = super().resample_streams(epoch, stream_id)
        return (units, ids) if self.held_out is None else without_held(units, ids, self.held_out)

    def unaugmented(self, index: int) -> dict[str, Any]:
        """Sample `index` as an evaluation reads it (a held-out sample: data/holdout.py)."""
        return self[index]

    def _all_local(self) -> bool:
        return all(stream.remote in (None, stream.local) for stream in self.streams)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        if not (self.iterate_local_directly and self._all_local()):
            yield from super().__iter__()
            return
        stop_epoch_threads(self)  # a threaded epoch before this one: stop its threads
        # streaming 0.13's __iter__ up to its threads: workers, resume state or next epoch, ids.
        for sample_id in epoch_sample_ids(self):
            if sample_id != -1:  # streaming's padding where a partition is short
                yield self[sample_id]
