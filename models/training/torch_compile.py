"""torch.compile of the denoiser, as `model.compile_unet` asks (models/build.py): in place, static
shapes (one graph per aspect-ratio bucket shape), a recompile limit that fits many buckets, and under
CUDA graphs a new CUDA-graph step marked at every denoiser call."""

import logging

import torch

from compat.torch import raise_recompile_limit

log = logging.getLogger(__name__)


# torch.compile modes that run the compiled graphs as CUDA graphs: in torch 2.7
# (torch._inductor.list_mode_options) "reduce-overhead" and "max-autotune" set triton.cudagraphs,
# "default" and "max-autotune-no-cudagraphs" do not; tests/test_compile.py checks it against torch.
CUDAGRAPH_MODES = ("reduce-overhead", "max-autotune")
# Graphs dynamo keeps per compiled function before it runs new inputs eagerly (torch 2.7's default,
# 8): static shapes compile one per aspect-ratio bucket shape, per train/eval mode and grad mode
# (sampling's guided batch is another shape), and a run with more than 8 of those would train its
# later buckets uncompiled, with a warning only.
RECOMPILE_LIMIT = 64


def compile_denoiser(denoiser: torch.nn.Module, options: dict) -> None:
    """torch.compile `denoiser` in place with `options` (torch.compile's keywords), static shapes
    unless they give `dynamic`."""
    # Static: a dynamic-shape graph (dynamo's default from the second shape it sees) computes sizes
    # on the host at every call and runs kernels generic in them; a graph per bucket shape is
    # specialised to it (and CUDA graphs record one per shape either way).
    options = {"dynamic": False, **options}
    # Global: dynamo's config is the process's, so every compiled function gets this limit.
    limit = raise_recompile_limit(RECOMPILE_LIMIT)
    log.debug("dynamo recompile limit: %d graphs per compiled function", limit)
    if uses_cudagraphs(options):
        denoiser.register_forward_pre_hook(_new_cudagraph_step)
    # In place (nn.Module.compile), not torch.compile(unet): a wrapper would rename every
    # weight to `_orig_mod.*` in checkpoints, EMA and export.
    denoiser.compile(**options)


def compiles_with_cudagraphs(compile_unet) -> bool:
    """Whether `model.compile_unet` (false, true or a dict of torch.compile options) runs the
    denoiser under CUDA graphs."""
    return isinstance(compile_unet, dict) and uses_cudagraphs(compile_unet)


def uses_cudagraphs(options: dict) -> bool:
    """Whether torch.compile with `options` replays its graphs as CUDA graphs (cudagraph trees)."""
    if options.get("backend") == "cudagraphs":  # dynamo's backend of that name: AOT graphs, replayed
        return True
    inductor = options.get("options") or {}
    if "triton.cudagraphs" in inductor:  # torch.compile refuses `mode` and `options` together
        return bool(inductor["triton.cudagraphs"])
    return options.get("mode") in CUDAGRAPH_MODES


@torch.compiler.disable
def _new_cudagraph_step(module: torch.nn.Module, args) -> None:
    """A forward pre-hook on the compiled denoiser: every call is a new CUDA-graph step.

    Under CUDA graphs (torch.compile's cudagraph trees) a replay writes its outputs into the same
    static memory as the previous replay. Cudagraph trees reuse that memory only once they decide a
    new step has begun, by default at a compiled call while no backward is pending; otherwise they
    keep the earlier outputs alive and record a second graph beside the first (recording time and
    memory). In our path no denoiser call needs an earlier call's outputs: a microbatch's loss is
    taken and its backward run before the next microbatch's forward, and what Composer still holds
    of it (`state.outputs`) is replaced by that forward's result and read by nothing in between;
    evaluation and sampling read only their own call's output. So each call is marked a new step,
    and the one graph per shape is replayed every microbatch, also where the default would misread
    the step (a training-mode forward whose backward never ran, e.g. one whose backward ran out of
    memory and that Composer's automatic microbatching retries smaller). Reading an earlier call's
    output after the next call raises torch's "overwritten by a subsequent run" error, never stale
    data. Gradients, which autograd would otherwise take over from a graph's output, are kept out of
    the graphs' memory by extensions/persistent_grads.py (recipes/trainer.py adds it).

    A hook, not code around the compiled call, kept out of dynamo (`torch.compiler.disable`): it
    runs as plain Python before the forward's graph (tests/test_compile.py checks the order). Torch
    2.7 runs `nn.Module.compile`'s hooks as frames of their own, so this is no graph break; traced,
    the hook would get guards and recompiles of its own (on grad mode) and dynamo would process every
    frame that importing cudagraph_trees runs.
    """
    torch.compiler.cudagraph_mark_step_begin()
