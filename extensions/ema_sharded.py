"""The EMA's average of a model sharded with FSDP2 (torch `fully_shard`, recipes/parallelism.py).

Under FSDP2 every trainable parameter is a DTensor: each rank holds its shard (rows of dim 0; HSDP:
the same shard in every copy). The average is sharded the same way: a DTensor per parameter with the
parameter's mesh, placements, shape and strides, over this rank's part of one flat buffer, so it costs
4 bytes per parameter / shard count, and updating it is a local lerp of shard into shard with no
communication. Checkpoints hold these DTensors: torch distributed checkpoint saves each rank's shard
beside its model's and loads them into the template Composer builds from `state_dict()` before the
load, on any number of ranks. So the template must exist before Composer loads: the EMA allocates the
sharded average when it binds (Event.BEFORE_LOAD, right after Composer shards the model), and before
`ema_start` it is a placeholder that the start overwrites with the weights then.

torch distributed checkpoint pickles an algorithm's state whole (Composer 0.32.1 keeps algorithms'
states as (name, state) tuples, which DCP does not traverse): rank 0's shards alone would be saved.
So the DTensors travel in a callback's state, `EMAShards`, a dict that DCP saves shard by shard; the
EMA's own state says `ema: SHARDED`. models/checkpoints/sharded_checkpoint.py puts the average back in the
EMA's state when it reads such a checkpoint for export.

Swapping the average in for evaluation copies it into the parameters' shards (the raw shards kept
aside) and reshards every FSDP2 module, so the next forward gathers what the shards hold now.
"""

import torch
from composer.core import Callback
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

# The EMA's state's `ema` under FSDP2 (models/checkpoints/sharded_checkpoint.py reads the same words).
SHARDED = "sharded: in callbacks.EMAShards"


class EMAShards(Callback):
    """Carries a sharded EMA's average (DTensors) in checkpoints; the EMA adds it at BEFORE_LOAD."""

    def __init__(self, ema):
        self.ema = ema

    def state_dict(self) -> dict:
        return {"ema": self.ema.sharded_average()}

    def load_state_dict(self, state: dict) -> None:
        # torch distributed checkpoint loaded into the tensors state_dict() gave it, the average itself.
        average = self.ema.sharded_average()
        if state["ema"].keys() != average.keys() or any(state["ema"][n] is not t for n, t in average.items()):
            raise ValueError("EMA: a sharded checkpoint's average was not loaded into this run's average")


def is_sharded(params: list[torch.Tensor]) -> bool:
    """Whether the parameters are FSDP2's (DTensors)."""
    return any(isinstance(p, DTensor) for p in params)


def local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (a view: writing it writes the DTensor); a tensor itself."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def sharded_like(params: list[torch.Tensor], dtype: torch.dtype) -> tuple[list[DTensor], list[torch.Tensor]]:
    """(DTensors laid out like `params`, their local shards): one flat buffer per device holds this
    rank's shards of all of them, initialised with the parameters' values."""
    shards = [local(p).detach() for p in params]
    by_device: dict[torch.device, list[int]] = {}
    for i, shard in enumerate(shards):
        by_device.setdefault(shard.device, []).append(i)
    views: list[torch.Tensor] = [None] * len(params)
    for device, indices in by_device.items():
        flat = torch.empty(sum(shards[i].numel() for i in indices), dtype=dtype, device=device)
        offset = 0
        for i in indices:
            views[i] = flat[offset : offset + shards[i].numel()].view(shards[i].shape)
            views[i].copy_(shards[i])
            offset += shards[i].numel()
    averages = [
        DTensor.from_local(v, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride())
        for v, p in zip(views, params)
    ]
    return averages, views


def reshard(model: torch.nn.Module) -> None:
    """Free every FSDP2 module's gathered weights, so that the next forward gathers the shards again."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()
