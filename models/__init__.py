"""The models: `build(preset, **options)` is the ComposerModel a run config's `model:` section names.

engine/ is what every family is made of, families/<name>/ one folder per family, registry.py the only
list of them and of the presets; build.py and components.py build a run's model, checkpoints/ reads
and writes it, export.py, generate.py and flops.py are the commands (docs/development.md has the tour).
"""

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
