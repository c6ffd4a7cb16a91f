"""What code asks of a preset (models.registry.PRESETS, joined from each family folder's presets.py:
sd2-base, sd2-768-v, sd15, tiny; sdxl-base, sdxl-tiny; sd3-medium, mmdit-tiny, mmdit-tiny-t5;
flux-schnell, flux-dev, flux-tiny).
"""

from models.engine.family import DENOISERS
from models.registry import PRESETS


def bundled_t5(preset: str) -> bool:
    """Whether `preset` builds its T5 (random weights) and T5 tokenizer (offline) itself, as
    mmdit-tiny-t5 and flux-tiny do; sd3-medium's and the FLUX.1 presets' T5 tokenizer only loads from
    a pretrained folder."""
    return bool(PRESETS[preset].get("bundled_t5", False))


def denoiser_name(preset: str) -> str:
    """The trained network's component name: "unet", or "transformer" (diffusers' names, whichever
    the preset configures; models.engine.family's `Family.denoiser` is the same name)."""
    return next(name for name in DENOISERS if name in PRESETS[preset])


def vae_factor(preset: str) -> int:
    """Pixels per latent along each side."""
    return 2 ** (len(PRESETS[preset]["vae"]["block_out_channels"]) - 1)


def denoiser_factor(preset: str) -> int:
    """Latents per smallest feature along each side: a transformer's patch size (times the preset's
    `packing`: Flux's 2x2), or the UNet's downsamplings (2 per level below the first)."""
    config = PRESETS[preset][denoiser_name(preset)]
    patch = patch_size(config) or 2 ** (len(config["block_out_channels"]) - 1)
    return PRESETS[preset].get("packing", 1) * patch


def patch_size(config) -> int:
    """A transformer's patch size from its config (a preset's dict, a model's FrozenDict): `patch_size`,
    or the largest of Z-Image's `all_patch_size`; 0 for a UNet, which has neither."""
    return config.get("patch_size") or max(config.get("all_patch_size") or [0])


def size_multiple(preset: str) -> int:
    """What image sides must be multiples of for `preset` (the VAE's factor x the denoiser's):
    8 x 8 = 64 for SD2, 8 x 4 = 32 for SDXL, 8 x 2 = 16 for SD3."""
    return vae_factor(preset) * denoiser_factor(preset)
