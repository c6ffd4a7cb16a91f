"""torch internals we rely on, written for torch 2.14.1 (first for 2.7.0).

- FSDP (FullyShardedDataParallel, the wrapper Composer 0.32 applies): a module's `_handle` (its
  FlatParamHandle, with `uses_sharded_strategy` and `needs_unshard()`) and
  `torch.distributed.fsdp._runtime_utils._reshard(state, handle, free_unsharded_flat_param)`. After a
  forward that expects a backward (SHARD_GRAD_OP, the root; also a no-grad evaluation) FSDP keeps
  the gathered weights and the next forward reuses them; extensions/ema.py writes the average into the
  shards and must make FSDP gather again (`free_gathered_weights`). FSDP's `_use_orig_params`:
  whether `parameters()` are the original parameters (views into the flat one), which the EMA needs
  (`uses_orig_params`).
- Modules below the public API, imported on first use (bench and tests only):
  `torch.utils._python_dispatch.TorchDispatchMode` (bench/ema.py counts the memory each op
  allocates); `torch.distributed.algorithms._checkpoint.checkpoint_wrapper` (CheckpointImpl,
  apply_activation_checkpointing, checkpoint_wrapper: what Composer applies for activation
  checkpointing, rebuilt by tests); `torch._dynamo.utils.counters` (tests check a compiled graph ran,
  and count compilations); `torch._dynamo.explain` (tests look for graph breaks);
  `torch._inductor.list_mode_options` (tests check which torch.compile modes use CUDA graphs).
- `torch._dynamo.config.recompile_limit` (torch 2.7's name; `cache_size_limit`, the old one, is an
  alias): the graphs dynamo compiles per function before it runs new inputs eagerly
  (`raise_recompile_limit`, for models/build.py's compile).
- `nn.Module._compiled_call_impl`: set by `Module.compile()` (in place); tests check it
  (`is_compiled`).
- `torch.fx.experimental._config.meta_nonzero_assume_all_nonzero`: on the meta device, nonzero (and
  so boolean-mask indexing) selects every element instead of refusing; models/flop_count.py counts a
  model whose condition keeps only a caption's real tokens at its longest (`meta_selects_all`).

`torch._foreach_*` (extensions/ema.py, extensions/master_weights.py, extensions/persistent_grads.py) is
left out: documented and stable in practice.
"""

import contextlib
import importlib
from typing import Any

import torch
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp._runtime_utils import _reshard

_CHECKPOINT_WRAPPER = "torch.distributed.algorithms._checkpoint.checkpoint_wrapper"
_LAZY = {
    "TorchDispatchMode": "torch.utils._python_dispatch",
    "CheckpointImpl": _CHECKPOINT_WRAPPER,
    "apply_activation_checkpointing": _CHECKPOINT_WRAPPER,
    "checkpoint_wrapper": _CHECKPOINT_WRAPPER,
    "counters": "torch._dynamo.utils",
    "explain": "torch._dynamo",
    "list_mode_options": "torch._inductor",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def free_gathered_weights(root: torch.nn.Module) -> None:
    """Free the gathered (unsharded) weights that every sharded FSDP module under `root` still
    holds, so that its next forward gathers the shards again. Unsharded handles (NO_SHARD, FSDP's
    choice on one process) are left alone: their parameters are the flat parameter itself."""
    for module in FSDP.fsdp_modules(root):
        handle = module._handle
        if handle is not None and handle.uses_sharded_strategy and not handle.needs_unshard():
            _reshard(module, handle, True)


def uses_orig_params(module: FSDP) -> bool:
    """Whether an FSDP module was built with use_orig_params=True."""
    return module._use_orig_params


def is_compiled(module: torch.nn.Module) -> bool:
    """Whether `module.compile()` has been called on `module` (nn.Module.compile works in place)."""
    return module._compiled_call_impl is not None


@contextlib.contextmanager
def meta_selects_all():
    """Inside: a data-dependent selection of meta tensors (nonzero, `x[mask]`) keeps every element,
    where torch otherwise raises (the meta device holds no values to select by)."""
    from torch.fx.experimental import _config

    with _config.patch(meta_nonzero_assume_all_nonzero=True):
        yield


def raise_recompile_limit(at_least: int) -> int:
    """Raises dynamo's recompile limit to `at_least` (never lowers it) and returns the limit now in
    force. Global: dynamo's config belongs to the process, so every compiled function gets it."""
    from torch._dynamo import config

    config.recompile_limit = max(config.recompile_limit, at_least)
    return config.recompile_limit
