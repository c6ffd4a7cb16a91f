"""`model.base_weights`: a LoRA run's frozen base held in bf16, float8 or NF4 (QLoRA's 4-bit NormalFloat),
the adapter and its AdamW state in fp32.

What is stored so: the denoiser (the adapted network) and the family's large text encoders, the
ones that are not CLIP (`large_encoders`: Flux's T5-XXL, SD3's T5 when loaded, Z-Image's Qwen3); the
VAE and the CLIPs stay as loaded (fp32: 0.2-0.8 B parameters). Each of those networks is cast to bf16
whole (norms, embeddings, biases, convolutions), then, for `fp8` and `nf4`, the weight of each
`nn.Linear` is replaced by one of torchao's weight-only tensors (public names, torchao 0.18):
- fp8: `quantize_(layer, Float8WeightOnlyConfig())`, a `Float8Tensor` of float8_e4m3fn values with one
  fp32 scale per output row: 1 byte per weight + 4 per row. The matmul runs in bf16 on the weight
  dequantized on each call (weight-only: no float8 kernel), on the CPU as on a GPU.
- nf4: torchao's `to_nf4` (torchtune's QLoRA), an `NF4Tensor`: 4-bit codes in blocks of 64 weights,
  each block's absmax scale stored as int8 ("double quantisation", one bf16 factor per 256 scales, the
  scales' mean): 0.5 + 1/64 bytes per weight and a few bytes per layer (`linear_bytes`; 0.51575 bytes
  per weight on a 3072 x 3072 layer, measured on the tensor in tests/test_quantized_base.py). A
  layer whose block count 256 does not divide (only toy widths) gets the largest divisor below 256 as
  its scale group; one whose size 64 does not divide stays bf16.
Order: quantize first, then `add_lora`, so that peft wraps the quantized layers with its own torchao
support: a `Float8Tensor` weight (a TorchAOBaseTensor) gets peft's `TorchaoLoraLinear`, an
`NF4Tensor` (a plain tensor subclass) peft's `lora.Linear`, whose base call goes through NF4's own
autograd function (dequantise in forward and backward, save only the 4-bit weight). peft casts a new
adapter to its base layer's dtype (bf16 here); `upcast_adapter` casts it back to fp32 as diffusers'
LoRA scripts do (`cast_training_params`), so the optimizer steps and keeps fp32.

Activations: a frozen bf16 layer saves its input only for the adapter and its weight by reference;
so do NF4's layers. torchao's Float8Tensor linear dequantises in plain autograd, which would save a
bf16 copy of every weight until the backward (the whole base again); `FrozenFloat8Linear` saves the
float8 weight instead and dequantises once more in the backward, so all three keep the activations
of a bf16 base (tests/test_quantized_base.py counts the saved bytes).
"""

import logging
import warnings

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

BASE_WEIGHTS = ("bf16", "fp8", "nf4")
QUANTIZED = ("fp8", "nf4")  # stored as torchao tensors; bf16 is a cast
NF4_BLOCK = 64  # torchao's to_nf4 default and QLoRA's block size
NF4_SCALE_GROUP = 256  # torchao's default scaler_block_size: scales quantised to int8 in groups of 256
NF4_LUT = 16  # the 16 NormalFloat levels, stored with each tensor in its dtype


def large_encoders(preset: str) -> list[str]:
    """The family's text encoders that `base_weights` stores too: every one but the CLIPs."""
    from transformers import CLIPTextModel, CLIPTextModelWithProjection, PreTrainedModel

    from models.registry import of

    return [
        name
        for name, cls in of(preset).components.items()
        if name.startswith("text_encoder")
        and isinstance(cls, type)
        and issubclass(cls, PreTrainedModel)
        and not issubclass(cls, (CLIPTextModel, CLIPTextModelWithProjection))
    ]


def check_base_weights(base_weights, preset: str, lora, param_dtype, fp8) -> None:
    """One-line errors for a value, a family or a combination `store_base` cannot serve."""
    from models.registry import of
    from models.training.fp8 import fp8_recipe

    if base_weights is None:
        return
    if base_weights not in BASE_WEIGHTS:
        raise ValueError(
            f"model.base_weights={base_weights!r}; choose one of {list(BASE_WEIGHTS)}, or null (the base "
            "as loaded, fp32)"
        )
    if lora is None:
        raise ValueError(
            f"model.base_weights={base_weights} stores a LoRA run's frozen base, and this run trains no "
            "adapter: set model.lora too, or leave model.base_weights unset"
        )
    family = of(preset)
    if base_weights in QUANTIZED and family.denoiser != "transformer":
        raise ValueError(
            f"model.base_weights={base_weights} quantizes a transformer's linear layers; preset {preset!r} "
            f"(family {family.name}) is a UNet, whose bf16 base fits any GPU that trains it: use "
            "model.base_weights=bf16"
        )
    if param_dtype not in (None, "float32"):
        raise ValueError(
            f"model.base_weights={base_weights} keeps the adapter fp32 and model.param_dtype={param_dtype} "
            "would cast it: leave model.param_dtype unset"
        )
    if fp8_recipe(fp8) is not None:
        raise ValueError(
            f"model.base_weights={base_weights} with model.fp8: Float8Linear trains high-precision weights, "
            "not a frozen stored base: leave model.fp8 unset"
        )


def nf4_group(numel: int) -> int | None:
    """The NF4 scale group of a weight of `numel` values: NF4_SCALE_GROUP, the largest divisor of its
    block count below it for a toy width, None where NF4_BLOCK does not divide it (left bf16)."""
    if numel % NF4_BLOCK:
        return None
    blocks = numel // NF4_BLOCK
    return max(d for d in range(1, NF4_SCALE_GROUP + 1) if blocks % d == 0)


def linear_bytes(out_features: int, in_features: int, base_weights: str | None) -> int:
    """Bytes of one linear layer's weight as `base_weights` stores it (None: fp32)."""
    numel = out_features * in_features
    if base_weights == "fp8":
        return numel + 4 * out_features  # float8 values, an fp32 scale per row
    if base_weights == "nf4" and (group := nf4_group(numel)) is not None:
        blocks = numel // NF4_BLOCK
        # codes, int8 block scales, a bf16 factor per scale group, the scales' mean, the levels
        return numel // 2 + blocks + 2 * (blocks // group) + 2 + 2 * NF4_LUT
    return numel * (4 if base_weights is None else 2)


def stored_bytes(network: torch.nn.Module, base_weights: str | None) -> int:
    """Bytes of `network`'s frozen parameters stored as `base_weights` (shapes only: meta works)."""
    linear = {
        id(m.weight): m.weight.shape
        for m in network.modules()
        if type(m) is torch.nn.Linear and not m.weight.requires_grad
    }
    total = 0
    for p in network.parameters():
        if p.requires_grad:
            continue
        if id(p) in linear and base_weights in QUANTIZED:
            total += linear_bytes(*linear[id(p)], base_weights)
        else:
            total += p.numel() * (4 if base_weights is None else 2)
    return total


class _DequantizedLinear(torch.autograd.Function):
    """x @ W^T for a frozen float8 W, saving W itself (not its bf16 dequantisation) for the backward."""

    @staticmethod
    def forward(ctx, x, weight):
        ctx.save_for_backward(weight)
        return F.linear(x, weight.dequantize().to(x.dtype))

    @staticmethod
    def backward(ctx, grad):
        (weight,) = ctx.saved_tensors
        return grad @ weight.dequantize().to(grad.dtype), None


class FrozenFloat8Linear(torch.nn.Linear):
    """An nn.Linear whose weight is torchao's Float8Tensor (the layer's class swapped in place, its
    parameters and state-dict names kept)."""

    def forward(self, x):
        out = _DequantizedLinear.apply(x, self.weight)
        return out if self.bias is None else out + self.bias.to(out.dtype)


def _quantize_linears(network: torch.nn.Module, base_weights: str) -> tuple[int, int]:
    """Replace the weights of `network`'s linear layers; (layers quantized, layers left bf16)."""
    from torchao.quantization import Float8WeightOnlyConfig, quantize_, to_nf4

    done = left = 0
    for module in [m for m in network.modules() if type(m) is torch.nn.Linear]:
        if base_weights == "fp8":
            # set_inductor_config=False: torchao would otherwise change inductor's global settings
            quantize_(module, Float8WeightOnlyConfig(set_inductor_config=False))
            module.__class__ = FrozenFloat8Linear
        elif (group := nf4_group(module.weight.numel())) is not None:
            weight = to_nf4(module.weight.detach(), NF4_BLOCK, group)
            module.weight = torch.nn.Parameter(weight, requires_grad=False)
        else:
            left += 1
            continue
        done += 1
    return done, left


def store_base(parts: dict, denoiser_name: str, preset: str, base_weights: str) -> None:
    """Cast (bf16) or quantize (fp8, nf4) the frozen denoiser and large encoders among `parts`, in
    place, before the adapter is added."""
    names = [denoiser_name, *(n for n in large_encoders(preset) if parts.get(n) is not None)]
    for name in names:
        network = parts[name]
        network.requires_grad_(False)
        torch.nn.Module.to(network, torch.bfloat16)  # nn.Module's: diffusers' own warns needlessly
        if base_weights in QUANTIZED:
            done, left = _quantize_linears(network, base_weights)
            log.info("model.base_weights=%s: %s has %d linear layers in %s (%d left bf16)",
                     base_weights, name, done, base_weights, left)  # fmt: skip
        else:
            log.info("model.base_weights=bf16: %s stored in bf16", name)


def add_adapter_over(denoiser, base_weights: str | None, lora: dict) -> None:
    """`add_lora` over a stored base: peft's TorchaoLoraLinear warns, once per process, that it cannot
    merge without a re-quantisation recipe; nothing here merges into a quantized base (models.export
    merges into the full-precision one), so the warning is dropped."""
    from models.training.lora import add_lora

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="TorchaoLoraLinear was instantiated without")
        add_lora(denoiser, **lora)
    if base_weights is not None:
        upcast_adapter(denoiser)


def upcast_adapter(denoiser) -> None:
    """The adapter's weights back in fp32 (peft made them in the base layer's dtype)."""
    from diffusers.training_utils import cast_training_params

    cast_training_params(denoiser, dtype=torch.float32)
