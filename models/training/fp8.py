"""`model.fp8`: a transformer's block matmuls trained in float8 with torchao's Float8Linear.

Which layers: the `nn.Linear`s inside the transformer's blocks (the FSDP units, models/training/sharding.py:
attention projections and MLPs, which hold nearly all of a step's FLOPs) whose in and out features are
multiples of 16 (float8 matmuls need it: torch._scaled_mm). Left in bf16/fp32: each block's adaLN
modulation (`norm*.linear`: an input of one row per sample, nothing to gain, and it sets every block's
scale and gate), the embedders, the time and text MLPs and the final layer (small matmuls next to the
blocks', and the ones that set the scale of everything downstream).

The recipes are torchao's (`Float8LinearRecipeName`): "rowwise" (a scale per row, the CUTLASS
kernel; the default of `fp8: true`), "tensorwise" (one scale per tensor, cuBLAS) and
"rowwise_with_gw_hp" (the weight gradient in high precision). Float8Linear keeps its weight a plain
parameter under the same name and casts on each call, so checkpoints, EMA, resume and export are those
of the model without it: an export is the high-precision weights (models/export.py rebuilds plain
Linear layers from the record), loadable in bf16 or fp32. Autograd saves the high-precision input for
the backward, so the activations are those of a bf16 run (recipes/footprint.py counts them with these
same modules).

On a GPU without float8 matmuls (below sm_89: A100, V100) this is an error; on a machine without CUDA,
or for a run on the CPU (`cpu_emulation()`, recipes/trainer.py: trainer.device cpu), the matmuls are
emulated in high precision with the same casts and scales, which is slower than not using it and meant
for checking, never for speed.

`pad_inner_dim`: torch._scaled_mm also needs the inner dimension a multiple of 16, and in the weight
gradient (grad_output^T @ input) that is the microbatch's token count: SD3's 154 context tokens, or
an aspect bucket's odd patch count, would fail on a GPU (emulation checks nothing). torchao pads those
matmuls with zeros (a copy of each float8 operand), which costs memory traffic even where no padding
is needed; its speed is to be measured on a GPU.
"""

import contextlib
import dataclasses
import logging

import torch
from torchao.float8 import Float8LinearConfig, convert_to_float8_training

from models.training.sharding import units

log = logging.getLogger(__name__)

RECIPES = ("rowwise", "tensorwise", "rowwise_with_gw_hp")  # torchao's Float8LinearRecipeName values
DEFAULT_RECIPE = "rowwise"  # `model.fp8: true`
FP8_CAPABILITY = (8, 9)  # Ada and Hopper on: the first compute capability with float8 tensor cores
DIVISOR = 16  # torch._scaled_mm's rule for both dimensions of a float8 weight


def fp8_recipe(fp8) -> str | None:
    """`model.fp8` as a recipe name: None when off (false, null), DEFAULT_RECIPE for true."""
    if fp8 is None or fp8 is False:
        return None
    if fp8 is True:
        return DEFAULT_RECIPE
    if fp8 not in RECIPES:
        raise ValueError(
            f"model.fp8={fp8!r}; choose true (= {DEFAULT_RECIPE}), false or one of {list(RECIPES)}"
        )
    return fp8


_ON_CPU = [False]  # set by `cpu_emulation`: the model being built trains on the CPU


@contextlib.contextmanager
def cpu_emulation(on_cpu: bool = True):
    """Models built inside train on the CPU: emulate float8 whatever GPU the machine has."""
    before, _ON_CPU[0] = _ON_CPU[0], on_cpu
    try:
        yield
    finally:
        _ON_CPU[0] = before


def emulated(device: torch.device | None = None) -> bool:
    """Whether float8 matmuls are emulated: yes for a CPU run or without CUDA; an error on a GPU that
    has no float8 tensor cores."""
    if _ON_CPU[0] or not torch.cuda.is_available():
        return True
    capability = torch.cuda.get_device_capability(device)
    if capability < FP8_CAPABILITY:
        name = torch.cuda.get_device_name(device)
        raise RuntimeError(
            f"model.fp8 needs float8 tensor cores (compute capability 8.9 or newer: L4, L40S, H100, "
            f"B200); this GPU, {name}, is sm_{capability[0]}{capability[1]}: train without model.fp8"
        )
    return False


def _eligible(module: torch.nn.Module, name: str) -> bool:
    parent = name.rpartition(".")[0].rpartition(".")[2]  # "norm1" of "norm1.linear", "" of "proj_mlp"
    return (
        isinstance(module, torch.nn.Linear)
        and module.in_features % DIVISOR == 0
        and module.out_features % DIVISOR == 0
        and not parent.startswith("norm")  # adaLN modulation: norm1.linear, norm1_context.linear, norm.linear
    )


def convert_to_fp8(denoiser: torch.nn.Module, recipe: str, emulate: bool | None = None) -> int:
    """Swap the eligible linear layers of `denoiser`'s blocks (in place) for Float8Linear under
    torchao's `recipe`; return how many. `emulate`: None decides by the machine (`emulated()`)."""
    if emulate is None:
        emulate = emulated()
    config = Float8LinearConfig.from_recipe_name(recipe)
    config = dataclasses.replace(config, emulate=emulate, pad_inner_dim=True)
    swapped = 0
    for block in units(denoiser, "blocks"):
        before = sum(isinstance(m, torch.nn.Linear) for m in block.modules())
        convert_to_float8_training(block, module_filter_fn=_eligible, config=config)
        swapped += before - sum(type(m) is torch.nn.Linear for m in block.modules())
    if not swapped:
        raise ValueError(
            f"model.fp8: no linear layer of this {type(denoiser).__name__}'s blocks has both sides a "
            f"multiple of {DIVISOR}"
        )
    log.info("model.fp8=%s: %d linear layers train in float8%s", recipe, swapped, " (emulated)" * emulate)
    return swapped
