"""Model presets: a plain dict from name to the component configs, one module of presets per family
(models/presets_sd.py: sd2-base, sd2-768-v, sd15, tiny; presets_sdxl.py: sdxl-base, sdxl-tiny;
presets_sd3.py: sd3-medium, mmdit-tiny, mmdit-tiny-t5; presets_flux.py: flux-schnell, flux-dev,
flux-tiny; each module's docstring says where its numbers come from), and what code asks of a preset.
Weights are random: presets build architectures, not checkpoints.
"""

import torch
from transformers import PreTrainedModel

from models.presets_flux import FLUX
from models.presets_sd import SD, SD2_SCHEDULER  # noqa: F401 (SD2_SCHEDULER: imported from here)
from models.presets_sd3 import SD3
from models.presets_sdxl import SDXL

PRESETS = {**SD, **SDXL, **SD3, **FLUX}


def bundled_t5(preset: str) -> bool:
    """Whether `preset` builds its T5 (random weights) and T5 tokenizer (offline) itself, as
    mmdit-tiny-t5 and flux-tiny do; sd3-medium's and the FLUX.1 presets' T5 tokenizer only loads from
    a pretrained folder."""
    return bool(PRESETS[preset].get("bundled_t5", False))


# The trained network's component name in a diffusers pipeline folder: a UNet or a transformer.
DENOISERS = ("unet", "transformer")
# Components a family's model may go without: SD3's T5, built only by a `bundled_t5` preset.
OPTIONAL = ("text_encoder_3", "tokenizer_3")


def construct(cls, config: dict, recorded: bool = False):
    """A component of class `cls` from its config: a preset's (the keywords of its constructor), or a
    recorded one (`recorded`: the dict a diffusers or transformers config saves)."""
    if issubclass(cls, PreTrainedModel):
        config_class = cls.config_class
        return cls(config_class.from_dict(config) if recorded else config_class(**config))
    if recorded or not issubclass(cls, torch.nn.Module):  # a scheduler is built from its config alone
        return cls.from_config(config)
    return cls(**config)


def family(preset: str) -> str:
    """The name of `preset`'s family (models/family.py FAMILIES: which model class it builds)."""
    return PRESETS[preset].get("family", "sd")


def denoiser_name(preset: str) -> str:
    """The trained network's component name: "unet", or "transformer" (diffusers' names, whichever
    the preset configures; models.family's `Family.denoiser` is the same name)."""
    return next(name for name in DENOISERS if name in PRESETS[preset])


def vae_factor(preset: str) -> int:
    """Pixels per latent along each side."""
    return 2 ** (len(PRESETS[preset]["vae"]["block_out_channels"]) - 1)


def denoiser_factor(preset: str) -> int:
    """Latents per smallest feature along each side: a transformer's patch size (times the preset's
    `packing`: Flux's 2x2), or the UNet's downsamplings (2 per level below the first)."""
    config = PRESETS[preset][denoiser_name(preset)]
    patch = config.get("patch_size") or 2 ** (len(config["block_out_channels"]) - 1)
    return PRESETS[preset].get("packing", 1) * patch


def size_multiple(preset: str) -> int:
    """What image sides must be multiples of for `preset` (the VAE's factor x the denoiser's):
    8 x 8 = 64 for SD2, 8 x 4 = 32 for SDXL, 8 x 2 = 16 for SD3."""
    return vae_factor(preset) * denoiser_factor(preset)
