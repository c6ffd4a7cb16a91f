"""What the planner's memory columns read from the model (recipes/memory.py does the arithmetic): its
parameter counts and the bytes of activations one training sample keeps, found on the meta device (no
memory, no compute: about a second for sd3-medium).

Activations are the bytes autograd saves for the backward pass during the denoiser's training forward,
counted with `torch.autograd.graph.saved_tensors_hooks` over the model's own forward + backward (the
step models/flop_count.py counts FLOPs of, so a new family's step is counted as it is written), each
storage once and the parameters left out. At the end of the forward they are all alive at once: that
is the step's peak above its weights, gradients and optimizer state. tests/test_plan_memory.py
measures the peak of the tiny UNet and MMDiT on the CPU (torch.profiler's memory timeline) within 5%
of this count, with and without recomputed units.
- Attention: on the meta device torch's scaled_dot_product_attention takes its math path, which keeps
  a tokens x tokens matrix per head; the kernels that train (CUDA's flash and memory-efficient ones,
  the CPU's flash one) keep q, k, v, the output and one fp32 logsumexp per row, so the count runs
  with a stand-in that saves exactly those.
- Precision: counted in fp32, or with the denoiser and its inputs in bf16 for a bf16 run (autocast
  or bf16 weights). Under autocast some saved tensors stay fp32 (a norm's input where the norm runs
  in fp32, softmax statistics), so a bf16 figure is a lower bound; not yet compared with a GPU's peak.
- Recomputed units (activation checkpointing): each keeps only its inputs, and the backward pass runs
  one unit's forward again at a time, holding that unit's activations once more.
"""

import contextlib
import functools
import json
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from models.engine.family import T5_ENCODER, construct
from models.flop_count import training_step
from models.flops import latent_size, meta_model
from models.presets import bundled_t5
from models.registry import PRESETS, of
from models.training.sharding import units


@dataclass(frozen=True)
class Footprint:
    trainable: int  # parameters the optimizer steps (a LoRA run's adapter)
    frozen: int  # parameters held but not trained: VAE, text encoders, a LoRA run's base
    gathered: int  # parameters FSDP holds unsharded at once: the root unit's and two units' (prefetch)
    activations: int  # bytes one training sample keeps for the backward pass
    # A LoRA run's frozen bytes by model.base_weights (None, bf16, fp8, nf4): the denoiser and large
    # encoders as models/training/base_weights.py stores them, the other frozen networks fp32.
    frozen_bytes: dict | None = None


class _FlashAttention(torch.autograd.Function):
    """What a fused attention kernel keeps for its backward: q, k, v, the output, a logsumexp per row."""

    @staticmethod
    def forward(ctx, q, k, v):
        out = torch.empty_like(q)  # the meta device computes nothing
        ctx.save_for_backward(q, k, v, out, q.new_empty(q.shape[:-1], dtype=torch.float32))
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, *_ = ctx.saved_tensors
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


@contextlib.contextmanager
def _fused_attention():
    """diffusers' attention processors call F.scaled_dot_product_attention at call time (Flux's through
    diffusers' attention dispatcher, by keyword: hence torch's argument names)."""
    math_path = F.scaled_dot_product_attention

    def sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, **kwargs):
        if attn_mask is not None or is_causal or query.shape[-1] != value.shape[-1]:
            return math_path(
                query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, **kwargs
            )
        return _FlashAttention.apply(query, key, value)

    F.scaled_dot_product_attention = sdpa
    try:
        yield
    finally:
        F.scaled_dot_product_attention = math_path


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    """The step draws its latents and noise levels with torch.randn: in `dtype`, as a bf16 run's are."""
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


def _tensors(args, kwargs) -> list[torch.Tensor]:
    return [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]


def _saved_bytes(denoiser, step, recomputed: list[torch.nn.Module]) -> tuple[int, int]:
    """(bytes, batch): what `step()` saves for the backward pass, recomputed units counted as such, and
    the batch size it ran (the denoiser's first tensor argument's first dimension)."""
    params = {id(p.untyped_storage()) for p in denoiser.parameters()}
    storages = {}  # id -> storage; held, so that no id is reused during the count
    inside = {}  # unit index -> [bytes saved inside it, bytes of its inputs]
    current, batch = [None], []

    def pack(t):
        s = t.untyped_storage()  # one Python object per storage: views share it
        if id(s) not in params and id(s) not in storages:
            storages[id(s)] = s
            if current[0] is not None:
                inside[current[0]][0] += s.nbytes()
        return t

    def enter(i):
        def hook(module, args, kwargs):
            current[0] = i
            inside[i][1] += sum(t.untyped_storage().nbytes() for t in _tensors(args, kwargs))

        return hook

    def first_call(module, args, kwargs):
        batch.append(_tensors(args, kwargs)[0].shape[0])

    handles = [denoiser.register_forward_pre_hook(first_call, with_kwargs=True)]
    for i, unit in enumerate(recomputed):
        inside[i] = [0, 0]
        handles.append(unit.register_forward_pre_hook(enter(i), with_kwargs=True))
        handles.append(unit.register_forward_hook(lambda *_: current.__setitem__(0, None)))
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), _fused_attention():
            step()
    finally:
        for handle in handles:
            handle.remove()
    total = sum(s.nbytes() for s in storages.values())
    if inside:  # each unit keeps its inputs instead; the backward re-runs the largest once more
        total += sum(kept - saved for saved, kept in inside.values()) + max(s for s, _ in inside.values())
    return total, batch[0]


@functools.cache
def _footprint(preset, resolution, bf16, lora_json, t5, fsdp_wrap, recomputed, fp8) -> Footprint:
    side = latent_size(preset, resolution)
    model = meta_model(preset)
    denoiser, held_only = model.denoiser, []
    with torch.device("meta"):
        # SD3's T5 loads from a folder: its config is the preset's. Held, not run: its context has the
        # shape of the zeros the step attends to without it.
        if t5 and not bundled_t5(preset):
            held_only.append(construct(of(preset).components[T5_ENCODER], PRESETS[preset][T5_ENCODER]))
        if lora_json is not None:
            from models.training.lora import add_lora

            add_lora(denoiser, **json.loads(lora_json))
    if bf16:
        torch.nn.Module.to(denoiser, torch.bfloat16)  # nn.Module's: diffusers' own warns needlessly
    if fp8 is not None:  # torchao's Float8Linear, emulated: what it saves for the backward is the same
        from models.training.fp8 import convert_to_fp8

        convert_to_fp8(denoiser, fp8, emulate=True)
    # Only the denoiser trains (the model class freezes the rest); of it, only an adapter under LoRA.
    trainable = sum(p.numel() for p in denoiser.parameters() if p.requires_grad)
    held = sum(p.numel() for n in [model, *held_only] for p in n.parameters())
    blocks = [sum(p.numel() for p in u.parameters()) for u in units(denoiser, fsdp_wrap)]
    root = sum(p.numel() for p in denoiser.parameters()) - sum(blocks)
    gathered = root + 2 * max(blocks, default=0)

    stored = None
    if lora_json is not None:
        stored = _stored_bytes(preset, model, held_only, held - trainable)

    with _default_dtype(torch.bfloat16 if bf16 else torch.float32):
        step = training_step(model, side, side)
        saved, batch = _saved_bytes(denoiser, step, units(denoiser, recomputed) if recomputed else [])
    return Footprint(trainable, held - trainable, gathered, saved // batch, stored)


def _stored_bytes(preset, model, held_only, frozen: int) -> dict:
    """A LoRA run's frozen bytes for each model.base_weights: the denoiser and the large encoders
    (models/training/base_weights.py; `held_only`: SD3's T5, held beside the model) as stored, the other
    `frozen` parameters fp32. Activations do not change with it: a stored layer keeps for the backward
    what a frozen bf16 one keeps (tests/test_quantized_base.py)."""
    from models.training.base_weights import BASE_WEIGHTS, large_encoders, stored_bytes

    encoders = [getattr(model, n) for n in large_encoders(preset) if getattr(model, n, None) is not None]
    stored = [model.denoiser, *encoders, *held_only]
    rest = frozen - sum(p.numel() for n in stored for p in n.parameters() if not p.requires_grad)
    return {w: 4 * rest + sum(stored_bytes(n, w) for n in stored) for w in (None, *BASE_WEIGHTS)}


def footprint(
    preset: str,
    resolution: int,
    *,
    bf16: bool = False,
    lora: dict | None = None,
    t5: bool = False,
    fsdp_wrap: str = "blocks",
    recomputed: str | None = None,
    fp8: str | None = None,
) -> Footprint:
    """`preset`'s footprint training at `resolution` px (square; a bucket of about as many pixels
    keeps about as much): bf16 activations or fp32, a LoRA adapter (`model.lora`, defaults filled in)
    as what trains, SD3's T5 loaded or not, FSDP units of `fsdp_wrap` granularity, and the units of
    `recomputed` granularity ("blocks", "layers", models/training/sharding.py) recomputed in the backward, and
    the blocks' linear layers in float8 under torchao's `fp8` recipe (models/training/fp8.py)."""
    lora_json = None if lora is None else json.dumps(lora, sort_keys=True)
    return _footprint(preset, resolution, bf16, lora_json, t5, fsdp_wrap, recomputed, fp8)
