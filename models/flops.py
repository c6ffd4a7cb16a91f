"""Training FLOPs per image and model FLOPs utilisation (MFU).

    python -m models.flops --preset sd2-base --resolution 256 512 [--images-per-sec 120 --gpu h100]

FLOPs are counted by `torch.utils.flop_counter.FlopCounterMode` over one forward + backward of the
denoiser (the UNet, or an mmdit preset's joint-attention transformer), the trained part of a step,
with models built on the meta device: no memory, no compute, about a second even for sd2-base. The
counter covers matmuls, convolutions and attention (the usual MFU convention); norms and elementwise
ops are left out. A transformer attends jointly over its image patches and its text context (77 CLIP
tokens and the preset's `t5_tokens` T5 ones, zeros or not): both streams' projections and MLPs and the
attention over both count. The frozen VAE encoder and text encoders also run forward every step;
`frozen_flops_per_image` counts them, separately, since MFU conventionally counts only the model
being trained.
"""

import argparse
import functools
import json
import logging

import torch
from diffusers import FluxTransformer2DModel, SD3Transformer2DModel, UNet2DConditionModel
from torch.utils.flop_counter import FlopCounterMode

from models.presets import PRESETS, denoiser_factor, denoiser_name, vae_factor

log = logging.getLogger(__name__)

CONTEXT_LENGTH = 77  # CLIP tokens: the UNet attends to a 77 x cross_attention_dim context
_BATCH = 2  # count a batch of 2 and divide, so no per-batch-of-1 shortcut can skew the count

# Dense (no sparsity) bf16 tensor-core peaks from the vendors' datasheets, FLOP/s.
PEAK_BF16_FLOPS = {
    "a100": 312e12,
    "h100": 989e12,  # SXM; the PCIe card is 756e12
    "h200": 989e12,
}


def context_length(preset: str) -> int:
    """Text tokens the denoiser attends to, as the family's conditioner says (models/conditioners.py:
    CLIP's 77, an mmdit preset's T5 part after them, Flux's T5 tokens alone)."""
    from models.family import of  # the family table imports the models, which import this module

    return of(preset).conditioner.context_tokens(PRESETS[preset].get("t5_tokens"))


def latent_size(preset: str, resolution: int) -> int:
    """The side of the latents for square images of `resolution` pixels, checked to fit the denoiser."""
    if preset not in PRESETS:
        raise ValueError(f"unknown model preset {preset!r}; choose one of {sorted(PRESETS)}")
    factor = vae_factor(preset)
    # Each UNet down block but the last halves the latents, and the up path must find the same sizes;
    # a transformer cuts the latents into patches.
    inner = denoiser_factor(preset)
    what = "patch size" if PRESETS[preset][denoiser_name(preset)].get("patch_size") else "UNet factor"
    if resolution <= 0 or resolution % (factor * inner):
        raise ValueError(
            f"resolution {resolution} for preset {preset!r} must be a positive multiple of "
            f"{factor * inner} (VAE factor {factor} x {what} {inner})"
        )
    return resolution // factor


def _count(fn) -> int:
    counter = FlopCounterMode(display=False)
    with counter:
        fn()
    return counter.get_total_flops()


def _meta_components(preset: str) -> dict:
    from models.family import build_components  # the family table imports the models, which import this

    with torch.device("meta"):
        return build_components(preset)


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


@functools.cache
def training_flops_per_image(preset: str, resolution: int) -> float:
    """FLOPs of the denoiser's forward + backward for one image of `resolution` x `resolution` pixels."""
    side = latent_size(preset, resolution)
    from models.family import of  # the family table imports the models, which import this module

    denoiser = _meta_components(preset)[denoiser_name(preset)]
    flops = of(preset).step_flops(denoiser, side, side, context_length(preset))
    log.info("%s at %d px (%dx%d latents): %.4g FLOP per image", preset, resolution, side, side, flops)
    return flops


def unet_training_flops(unet_config, height: int, width: int, context_length: int = CONTEXT_LENGTH) -> float:
    """Like `training_flops_per_image`, for any UNet: its diffusers config (`unet.config`, e.g. of a
    pretrained one), latents of height x width and a text context of `context_length` tokens.
    Counted on the meta device once per distinct argument set, then cached (what
    `StableDiffusion.flops_per_batch` calls every batch)."""
    return _cached_unet_training_flops(
        json.dumps(dict(unet_config), sort_keys=True, default=str),
        int(height),
        int(width),
        int(context_length),
    )


@functools.cache
def _cached_unet_training_flops(config_json: str, height: int, width: int, context_length: int) -> float:
    with torch.device("meta"):
        unet = UNet2DConditionModel.from_config(json.loads(config_json))
    flops = unet_step_flops(unet, height, width, context_length)
    log.info(
        "UNet at %dx%d latents, %d context tokens: %.4g training FLOP per image",
        height,
        width,
        context_length,
        flops,
    )
    return flops


def transformer_training_flops(transformer_config, height: int, width: int, context_length: int) -> float:
    """`unet_training_flops` for an SD3 transformer (its diffusers config), latents of height x width
    and a joint-attention context of `context_length` tokens; counted once per argument set, then
    cached (what `RectifiedFlowTransformer.flops_per_batch` calls every batch)."""
    return _cached_transformer_training_flops(
        json.dumps(dict(transformer_config), sort_keys=True, default=str),
        int(height),
        int(width),
        int(context_length),
    )


@functools.cache
def _cached_transformer_training_flops(
    config_json: str, height: int, width: int, context_length: int
) -> float:
    with torch.device("meta"):
        transformer = SD3Transformer2DModel.from_config(json.loads(config_json))
    flops = transformer_step_flops(transformer, height, width, context_length)
    log.info(
        "transformer at %dx%d latents, %d context tokens: %.4g training FLOP per image",
        height,
        width,
        context_length,
        flops,
    )
    return flops


def flux_training_flops(transformer_config, height: int, width: int, context_length: int) -> float:
    """`transformer_training_flops` for a Flux transformer (its diffusers config); counted once per
    argument set, then cached (what the Flux model's `flops_per_batch` calls every batch)."""
    return _cached_flux_training_flops(
        json.dumps(dict(transformer_config), sort_keys=True, default=str),
        int(height),
        int(width),
        int(context_length),
    )


@functools.cache
def _cached_flux_training_flops(config_json: str, height: int, width: int, context_length: int) -> float:
    with torch.device("meta"):
        transformer = FluxTransformer2DModel.from_config(json.loads(config_json))
    return flux_step_flops(transformer, height, width, context_length)


@functools.cache
def frozen_flops_per_image(preset: str, resolution: int) -> float:
    """FLOPs of the frozen forwards a training step also runs: VAE encoder + text encoder(s) (SDXL's
    and SD3's second CLIP too; not SD3's optional T5, off by default)."""
    latent_size(preset, resolution)  # the same checks
    components = _meta_components(preset)
    vae = components["vae"]
    encoders = [components[name] for name in ("text_encoder", "text_encoder_2") if name in components]
    with torch.device("meta"):
        images = torch.randn(_BATCH, vae.config.in_channels, resolution, resolution)
        input_ids = torch.zeros(_BATCH, CONTEXT_LENGTH, dtype=torch.long)

    def forward():
        with torch.no_grad():
            vae.encode(images).latent_dist.sample()
            for text_encoder in encoders:
                text_encoder(input_ids)

    return _count(forward) / _BATCH


def mfu(images_per_sec: float, flops_per_image: float, peak_flops: float) -> float:
    """Model FLOPs utilisation: achieved FLOP/s over the hardware's peak (per device: pass the
    images/s of one device, or the total with peak_flops x the number of devices)."""
    if peak_flops <= 0:
        raise ValueError(f"peak_flops must be positive, got {peak_flops}")
    if images_per_sec < 0 or flops_per_image < 0:
        raise ValueError("images_per_sec and flops_per_image must be non-negative")
    return images_per_sec * flops_per_image / peak_flops


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m models.flops", description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--preset", choices=sorted(PRESETS), default="sd2-base")
    parser.add_argument("--resolution", type=int, nargs="+", default=[256, 512], help="pixels")
    parser.add_argument("--images-per-sec", type=float, help="measured throughput per device, for MFU")
    peak = parser.add_mutually_exclusive_group()
    peak.add_argument("--gpu", choices=sorted(PEAK_BF16_FLOPS), help="take the bf16 peak of this GPU")
    peak.add_argument("--peak-tflops", type=float, help="peak TFLOP/s of one device")
    args = parser.parse_args(argv)
    peak_flops = PEAK_BF16_FLOPS[args.gpu] if args.gpu else (args.peak_tflops or 0) * 1e12
    if args.images_per_sec is not None and not peak_flops:
        parser.error("--images-per-sec needs --gpu or --peak-tflops")
    for resolution in args.resolution:
        try:
            latent_size(args.preset, resolution)
        except ValueError as error:
            parser.error(str(error))

    for resolution in args.resolution:
        train = training_flops_per_image(args.preset, resolution)
        frozen = frozen_flops_per_image(args.preset, resolution)
        name = "UNet" if denoiser_name(args.preset) == "unet" else denoiser_name(args.preset)
        line = (
            f"{args.preset} {resolution} px: {name} fwd+bwd {train / 1e12:.4g} TFLOP/image, "
            f"frozen VAE encoder + text encoders fwd {frozen / 1e12:.4g} TFLOP/image"
        )
        if args.images_per_sec is not None:
            line += f", MFU {mfu(args.images_per_sec, train, peak_flops):.1%}"
        print(line)


if __name__ == "__main__":
    main()
