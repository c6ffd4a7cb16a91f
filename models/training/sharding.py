"""Which parts of the denoiser (the UNet, or an mmdit preset's transformer) FSDP shards as its own
unit, and which it recomputes in the backward pass.

Composer's FSDP (composer/distributed/dist_strategy.py) wraps each child of the ComposerModel whose
`_fsdp_wrap` is not False (here only the UNet) and asks that child's `fsdp_wrap_fn(module)` which
submodules become their own FSDP units, and its `activation_checkpointing_fn(module)` which ones to
checkpoint when the FSDP config has `activation_checkpointing: true`. This module sets both.

Units, from coarse to fine:
  unet    the whole UNet is one unit: every microbatch gathers and reduce-scatters all of it at once,
          so nothing overlaps with compute, and the gathered copy is the whole model.
  blocks  each down block, the mid block and each up block (9 units on SD2): FSDP gathers the next
          block while the current one computes (backward/forward prefetch), and only a block's
          parameters are gathered at a time.
  layers  each ResNet block and each transformer (attention) block (~60 on SD2): smaller units,
          more collectives (38 units on SD2: 22 ResNet, 16 transformer); for memory pressure at high
          resolution.

A transformer (diffusers' SD3Transformer2DModel: models/families/mmdit/model.py) is a stack of identical
joint- attention blocks, so "blocks" and "layers" both make one unit per block (24 on sd3-medium, 84 M
parameters each): a block is the natural unit (the next one is gathered while this one computes,
and a recomputed block is one attention and two MLPs). Finer units (a block's attention, its MLPs)
would leave each block's adaptive-norm projections (14 M per stream) in the root unit, gathered for
the whole step. A Flux transformer's units are its double-stream blocks, then its single-stream ones
(diffusers' `_no_split_modules` of a transformer). "unet" keeps its name for the whole network (the
recipes' key), whichever it is.
"""

import torch
from diffusers import Transformer2DModel

from compat.diffusers import ResnetBlock2D

GRANULARITIES = ("unet", "blocks", "layers")


def units(unet: torch.nn.Module, granularity: str) -> list[torch.nn.Module]:
    """The denoiser's submodules at `granularity` (empty for "unet": the root is the only unit)."""
    if granularity not in GRANULARITIES:
        raise ValueError(f"{granularity!r} is not one of {GRANULARITIES}")
    if granularity == "unet":
        return []
    if not hasattr(unet, "down_blocks"):  # a transformer: its blocks, as diffusers names them
        return [m for m in unet.modules() if type(m).__name__ in type(unet)._no_split_modules]
    if granularity == "blocks":
        return [*unet.down_blocks, unet.mid_block, *unet.up_blocks]
    return [m for m in unet.modules() if isinstance(m, ResnetBlock2D | Transformer2DModel)]


class _Members:
    """`module in members` by identity; picklable, unlike a lambda."""

    def __init__(self, modules: list[torch.nn.Module]):
        self.ids = {id(m) for m in modules}

    def __call__(self, module: torch.nn.Module) -> bool:
        return id(module) in self.ids


def configure(unet: torch.nn.Module, fsdp_wrap: str = "blocks", activation_checkpointing: str | None = None):
    """Set `unet.fsdp_wrap_fn` and `unet.activation_checkpointing_fn` for Composer's FSDP (`unet`:
    the denoiser, a UNet or a transformer).

    activation_checkpointing: None, "blocks" or "layers": the units recomputed in the backward pass
    (takes effect under FSDP with `activation_checkpointing: true` in its config; without FSDP use
    the model's `gradient_checkpointing`, diffusers' own).
    """
    unet.fsdp_wrap_fn = _Members(units(unet, fsdp_wrap))
    checkpointed = units(unet, activation_checkpointing) if activation_checkpointing else []
    if activation_checkpointing == "unet":
        raise ValueError(
            "activation_checkpointing='unet' would recompute the whole model; use blocks or layers"
        )
    unet.activation_checkpointing_fn = _Members(checkpointed)
    return unet
