"""Stable Diffusion ComposerModel, its presets, and the builders a run config picks by preset name."""

import compat.torchao  # noqa: F401  (first: quiets what importing torchao logs; compat/torchao.py)
from models.autoencoder import Autoencoder, build_autoencoder
from models.build import build_model
from models.families.mmdit.model import RectifiedFlowTransformer
from models.families.sd.model import StableDiffusion
from models.families.sdxl.model import StableDiffusionXL
from models.registry import PRESETS

# `model.preset` in a run config -> the builder its other keys go to. `<preset>-vae` trains only
# that preset's VAE (yamls/tiny-vae.yaml).
MODELS = {
    **{name: build_model for name in PRESETS},
    **{f"{name}-vae": build_autoencoder for name in PRESETS},
}


def build(preset: str, **options):
    """The ComposerModel a run config's `model:` section describes."""
    if preset not in MODELS:
        raise ValueError(f"unknown model preset {preset!r}; choose one of {sorted(MODELS)}")
    return MODELS[preset](preset, **options)


__all__ = [
    "MODELS",
    "PRESETS",
    "Autoencoder",
    "RectifiedFlowTransformer",
    "StableDiffusion",
    "StableDiffusionXL",
    "build",
    "build_autoencoder",
    "build_model",
]
