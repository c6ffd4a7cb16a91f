"""A preset's stored form without its weights: what `sd-convert latents` stores of a caption
(models/engine/conditioners.py `encode`: `text_embeds`, and `pooled_text_embeds`, `text_embeds_3` where the
family has them), shaped by running the family's conditioner itself on meta-device text encoders and
meta token ids of the lengths it reads. So shapes and FLOPs (models/flops.py) come from the code path
that trains, for every family, at any size: flux-schnell's T5-XXL costs no memory or time here.
"""

import functools
from types import SimpleNamespace

import torch

from models.components import build_components
from models.engine.family import OPTIONAL, construct
from models.registry import PRESETS, of


def meta_parts(preset: str, t5: bool = False) -> SimpleNamespace:
    """`preset`'s VAE and text encoders on the meta device, held as the conditioner reads them (every
    component name of the family, None where none is built: SD3's T5 without `t5`), with its
    `t5_tokens`. `t5`: an optional T5 (OPTIONAL: SD3's `text_encoder_3`) too, from the preset's config."""
    family = of(preset)
    spec = PRESETS[preset]
    with torch.device("meta"):
        parts = build_components(preset, skip=(family.denoiser, "noise_scheduler"))
        for name in OPTIONAL if t5 else ():
            cls = family.components.get(name)
            if name not in parts and name in spec and cls is not None and issubclass(cls, torch.nn.Module):
                parts[name] = construct(cls, spec[name])
    lengths = {key: spec.get(key) for key in ("t5_tokens", "text_tokens")}  # T5's, an LLM's (Z-Image's)
    holder = {**dict.fromkeys(family.components), **parts, **lengths}
    return SimpleNamespace(**holder)


def meta_ids(parts: SimpleNamespace, conditioner, batch: int = 1) -> dict[str, torch.Tensor]:
    """Token ids on the meta device, (batch, length) for each column the conditioner reads."""
    lengths = conditioner.id_lengths(parts)
    return {name: torch.zeros(batch, n, dtype=torch.long, device="meta") for name, n in lengths.items()}


def stored_shapes(preset: str, t5: bool = False) -> dict[str, tuple[int, ...]]:
    """The shape of each stored-form tensor of one caption of `preset` (with an optional T5's context
    when `t5`): sd2-base {text_embeds: (77, 1024)}; sdxl-base (77, 2048) and pooled (1280,); sd3-medium
    (77, 2048) and pooled (2048,), with `t5` text_embeds_3 (77, 4096); flux-schnell (256, 4096) (T5's)
    and pooled (768,) (CLIP's). Counted once per process (a few seconds for a T5-XXL on meta)."""
    return dict(_stored_shapes(preset, t5))


@functools.cache
def _stored_shapes(preset: str, t5: bool) -> tuple[tuple[str, tuple[int, ...]], ...]:
    parts = meta_parts(preset, t5)
    conditioner = of(preset).conditioner
    stored = conditioner.encode(parts, meta_ids(parts, conditioner))
    return tuple((name, tuple(value.shape[1:])) for name, value in stored.items())
