"""The EMA (extensions/ema.py) under FSDP1 (`FullyShardedDataParallel`, use_orig_params: sdxl-base's
recipe), and the parameter names it keys the average by.

Under FSDP1 every parameter is a view into this rank's flat shard, so the average is built from those
local shards too, and a checkpoint holds it whole, gathered through FSDP (every rank takes part, rank
0 writes): it loads on any number of processes and exports like an unsharded one. (Under FSDP2 the
average is sharded and saved sharded instead: extensions/ema_sharded.py.)
"""

import torch
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

from compat.torch import free_gathered_weights


def strip_wrappers(name: str) -> str:
    """A parameter's name as the unwrapped model has it: DDP adds "module.", FSDP
    "_fsdp_wrapped_module." (activation checkpointing its own); checkpoints should not depend on how
    the model was wrapped."""
    name = name.removeprefix("module.")
    return name.replace("_fsdp_wrapped_module.", "").replace("_checkpoint_wrapped_module.", "")


def drop_gathered_weights(root: torch.nn.Module) -> None:
    """Make FSDP gather the shards again at the next forward. It keeps gathered weights after a
    forward when it expects a backward (SHARD_GRAD_OP, the root; also after a no-grad evaluation),
    and a forward reuses them, so weights written into the shards meanwhile would go unseen.
    Unsharded handles (NO_SHARD: FSDP's choice on one process) have nothing to drop: their
    parameters are the flat parameter itself, not a gathered copy."""
    free_gathered_weights(root)


@torch.no_grad()
def gather_average(ema) -> dict[str, torch.Tensor]:
    """`ema`'s whole average on the CPU, in its storage dtype (a collective: Composer calls
    state_dict on every rank). The average goes into this rank's shards, FSDP gathers them, the raw
    ones return."""
    tracked = set(ema._names)
    ema.swap_in()
    try:
        with FSDP.summon_full_params(ema._fsdp_root, writeback=False):
            return {
                name: p.detach().to("cpu", ema.storage, copy=True)
                for name, p in ((strip_wrappers(n), p) for n, p in ema._fsdp_root.named_parameters())
                if name in tracked
            }
    finally:
        ema.swap_out()


@torch.no_grad()
def scatter_average(ema, full: dict[str, torch.Tensor]) -> None:
    """Put this rank's shards of a whole average (`gather_average`'s) into `ema`'s average."""
    raw = [p.detach().clone() for p in ema._params]
    drop_gathered_weights(ema._fsdp_root)  # gather what the shards hold now
    with FSDP.summon_full_params(ema._fsdp_root, writeback=True):
        for n, p in ema._fsdp_root.named_parameters():
            if (name := strip_wrappers(n)) in full:
                p.copy_(full[name])
    for e, p, r in zip(ema._ema, ema._params, raw):
        e.copy_(p)
        p.copy_(r)
    drop_gathered_weights(ema._fsdp_root)
