"""FLOP counting of one denoiser forward + backward on the meta device, for any UNet, SD3 transformer
or Flux transformer, from the network itself (`*_step_flops`, which the family table names) or from its
diffusers config (`*_training_flops`, cached: what the models' `denoiser_flops` call every batch).
models/flops.py counts presets and MFU with these.
"""

import functools
import json
import logging

import torch
from diffusers import FluxTransformer2DModel, SD3Transformer2DModel, UNet2DConditionModel
from torch.utils.flop_counter import FlopCounterMode

log = logging.getLogger(__name__)

CONTEXT_LENGTH = 77  # CLIP tokens: the UNet attends to a 77 x cross_attention_dim context
_BATCH = 2  # count a batch of 2 and divide, so no per-batch-of-1 shortcut can skew the count


def _count(fn) -> int:
    counter = FlopCounterMode(display=False)
    with counter:
        fn()
    return counter.get_total_flops()


def unet_step_flops(unet, height: int, width: int, context_length: int) -> float:
    """FLOPs of one forward + backward of a meta-device `unet`, per image of height x width latents."""
    with torch.device("meta"):
        latents = torch.randn(_BATCH, unet.config.in_channels, height, width)
        context = torch.randn(_BATCH, context_length, unet.config.cross_attention_dim)
        timesteps = torch.randint(0, 1000, (_BATCH,))
        extra = {}
        if unet.config.addition_embed_type == "text_time":  # SDXL: pooled text + 6 micro-conditioning sizes
            time_ids = 6
            pooled = (
                unet.config.projection_class_embeddings_input_dim
                - time_ids * unet.config.addition_time_embed_dim
            )
            extra["added_cond_kwargs"] = {
                "text_embeds": torch.randn(_BATCH, pooled),
                "time_ids": torch.randn(_BATCH, time_ids),
            }

    def step():
        out = unet(latents, timesteps, encoder_hidden_states=context, **extra).sample
        out.float().pow(2).mean().backward()

    return _count(step) / _BATCH


def transformer_step_flops(transformer, height: int, width: int, context_length: int) -> float:
    """FLOPs of one forward + backward of a meta-device SD3 `transformer`, per image of height x width
    latents and a joint-attention context of `context_length` tokens."""
    config = transformer.config
    with torch.device("meta"):
        latents = torch.randn(_BATCH, config.in_channels, height, width)
        context = torch.randn(_BATCH, context_length, config.joint_attention_dim)
        pooled = torch.randn(_BATCH, config.pooled_projection_dim)
        timesteps = torch.rand(_BATCH) * 1000

    def step():
        out = transformer(
            hidden_states=latents,
            timestep=timesteps,
            encoder_hidden_states=context,
            pooled_projections=pooled,
        ).sample
        out.float().pow(2).mean().backward()

    return _count(step) / _BATCH


def flux_step_flops(transformer, height: int, width: int, context_length: int) -> float:
    """FLOPs of one forward + backward of a meta-device Flux `transformer` (FluxTransformer2DModel),
    per image of height x width latents, packed into 2 x 2 patches as FluxPipeline packs them, and a
    T5 context of `context_length` tokens (the guidance embedding too when it has one)."""
    config = transformer.config
    tokens = (height // 2) * (width // 2)
    with torch.device("meta"):
        latents = torch.randn(_BATCH, tokens, config.in_channels)
        context = torch.randn(_BATCH, context_length, config.joint_attention_dim)
        pooled = torch.randn(_BATCH, config.pooled_projection_dim)
        timesteps = torch.rand(_BATCH)
        img_ids, txt_ids = torch.zeros(tokens, 3), torch.zeros(context_length, 3)
        guidance = torch.ones(_BATCH) if config.guidance_embeds else None

    def step():
        out = transformer(
            hidden_states=latents,
            timestep=timesteps,
            encoder_hidden_states=context,
            pooled_projections=pooled,
            img_ids=img_ids,
            txt_ids=txt_ids,
            guidance=guidance,
        ).sample
        out.float().pow(2).mean().backward()

    return _count(step) / _BATCH


def unet_training_flops(unet_config, height: int, width: int, context_length: int = CONTEXT_LENGTH) -> float:
    """Like `training_flops_per_image`, for any UNet: its diffusers config (`unet.config`, e.g. of a
    pretrained one), latents of height x width and a text context of `context_length` tokens.
    Counted on the meta device once per distinct argument set, then cached (what
    `StableDiffusion.flops_per_batch` calls every batch)."""
    return _training_flops(UNet2DConditionModel, unet_step_flops, unet_config, height, width, context_length)


def transformer_training_flops(transformer_config, height: int, width: int, context_length: int) -> float:
    """`unet_training_flops` for an SD3 transformer (its diffusers config), latents of height x width
    and a joint-attention context of `context_length` tokens; counted once per argument set, then
    cached (what `RectifiedFlowTransformer.flops_per_batch` calls every batch)."""
    return _training_flops(
        SD3Transformer2DModel, transformer_step_flops, transformer_config, height, width, context_length
    )


def flux_training_flops(transformer_config, height: int, width: int, context_length: int) -> float:
    """`transformer_training_flops` for a Flux transformer (its diffusers config); counted once per
    argument set, then cached (what the Flux model's `flops_per_batch` calls every batch)."""
    return _training_flops(
        FluxTransformer2DModel, flux_step_flops, transformer_config, height, width, context_length
    )


def _training_flops(cls, step_flops, config, height: int, width: int, context_length: int) -> float:
    config_json = json.dumps(dict(config), sort_keys=True, default=str)
    return _cached_training_flops(cls, step_flops, config_json, int(height), int(width), int(context_length))


@functools.cache
def _cached_training_flops(cls, step_flops, config_json: str, height: int, width: int, context_length: int):
    with torch.device("meta"):
        denoiser = cls.from_config(json.loads(config_json))
    flops = step_flops(denoiser, height, width, context_length)
    log.info(
        "%s at %dx%d latents, %d context tokens: %.4g training FLOP per image",
        cls.__name__,
        height,
        width,
        context_length,
        flops,
    )
    return flops
