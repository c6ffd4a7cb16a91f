"""Training FLOPs per image and model FLOPs utilisation (MFU).

    python -m models.flops --preset sd2-base --resolution 256 512 [--images-per-sec 120 --gpu h100]

FLOPs are counted by `torch.utils.flop_counter.FlopCounterMode` over one forward + backward of the
denoiser (the UNet or transformer), the trained part of a step, as the preset's model calls it in
training (models/flop_count.py: its own condition, latent packing and denoiser call), with the model
built on the meta device: no memory, no compute, a few seconds even for flux-dev. The counter covers
matmuls, convolutions and attention (the usual MFU convention); norms and elementwise ops are left
out. A transformer attends jointly over its image patches and its text context (an mmdit preset's 77
CLIP tokens and its `t5_tokens` T5 ones, zeros or not): both streams' projections and MLPs and the
attention over both count. The frozen VAE encoder and text encoders also run forward every step;
`frozen_flops_per_image` counts them, separately, since MFU conventionally counts only the model
being trained.
"""

import argparse
import functools
import logging

import torch

from models.build import bundled_tokenizers
from models.components import build_components
from models.engine.family import construct
from models.flop_count import _BATCH, _count, step_flops
from models.presets import denoiser_factor, denoiser_name, patch_size, vae_factor
from models.registry import PRESETS, of, preset_options
from models.stored_form import meta_ids, meta_parts

log = logging.getLogger(__name__)

# Dense (no sparsity) bf16 tensor-core peaks from the vendors' datasheets, FLOP/s.
PEAK_BF16_FLOPS = {
    "a100": 312e12,
    "h100": 989e12,  # SXM; the PCIe card is 756e12
    "h200": 989e12,
}


def latent_size(preset: str, resolution: int) -> int:
    """The side of the latents for square images of `resolution` pixels, checked to fit the denoiser."""
    if preset not in PRESETS:
        raise ValueError(f"unknown model preset {preset!r}; choose one of {sorted(PRESETS)}")
    factor = vae_factor(preset)
    # Each UNet down block but the last halves the latents, and the up path must find the same sizes;
    # a transformer cuts the latents into patches.
    inner = denoiser_factor(preset)
    what = "patch size" if patch_size(PRESETS[preset][denoiser_name(preset)]) else "UNet factor"
    if resolution <= 0 or resolution % (factor * inner):
        raise ValueError(
            f"resolution {resolution} for preset {preset!r} must be a positive multiple of "
            f"{factor * inner} (VAE factor {factor} x {what} {inner})"
        )
    return resolution // factor


def _meta_components(preset: str) -> dict:
    with torch.device("meta"):
        return build_components(preset)


def meta_model(preset: str):
    """`preset`'s model (its family's class) with its networks on the meta device: no weights, no
    memory. Its tokenizers are the bundled ones (none for a T5 that only loads from a folder: the count
    makes its token ids itself), its options the preset's and the model class's defaults, which change
    no shape; its noise schedule is built on the CPU (the objectives read it when they are made)."""
    family = of(preset)
    with torch.device("meta"):
        parts = build_components(preset, skip=("noise_scheduler",))
    parts["noise_scheduler"] = construct(family.components["scheduler"], PRESETS[preset]["scheduler"])
    tokenizers = {
        **dict.fromkeys(n for n in family.components if n.startswith("tokenizer")),
        **bundled_tokenizers(preset),
    }
    return family.model_class(**parts, **tokenizers, **preset_options(preset))


@functools.cache
def training_flops_per_image(preset: str, resolution: int) -> float:
    """FLOPs of the denoiser's forward + backward for one image of `resolution` x `resolution` pixels,
    on the model's own training path (models/flop_count.py) from a batch of its token ids."""
    side = latent_size(preset, resolution)
    flops = step_flops(meta_model(preset), side, side)
    log.info("%s at %d px (%dx%d latents): %.4g FLOP per image", preset, resolution, side, side, flops)
    return flops


@functools.cache
def frozen_flops_per_image(preset: str, resolution: int) -> float:
    """FLOPs of the frozen forwards a training step on images also runs: the VAE encoder and the
    family's conditioner over each caption, as the model calls it (models/stored_form.py: every text
    encoder the preset builds, each at the length it reads: CLIP's 77 tokens, the preset's
    `t5_tokens` for a T5; not SD3's optional T5, which a preset without `bundled_t5` leaves off)."""
    latent_size(preset, resolution)  # the same checks
    parts = meta_parts(preset)
    conditioner = of(preset).conditioner
    ids = meta_ids(parts, conditioner, _BATCH)
    with torch.device("meta"):
        images = torch.randn(_BATCH, parts.vae.config.in_channels, resolution, resolution)

    def forward():
        with torch.no_grad():
            parts.vae.encode(images).latent_dist.sample()
            conditioner.encode(parts, ids)

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
