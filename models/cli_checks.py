"""The sampling commands' checks of numbers (models.generate, evaluation.evaluate, and the training
run's sample grids): each mistake is one line naming the flag or key, made before anything slow.

`name` is a flag (`--guidance`: the message says `--guidance -1`) or a config key (`guidance`: it
says `guidance=-1`, which recipes/config.py turns into `callbacks.samples.guidance=-1`).
"""

import math

from models.presets import patch_size
from models.registry import of_model


class UsageError(ValueError):
    """A value the command cannot use; the message names the flag or key (the CLIs print one line)."""


def _named(name: str, value) -> str:
    shown = f"{value:g}" if isinstance(value, float) else str(value)
    return f"{name} {shown}" if name.startswith("-") else f"{name}={shown}"


def check_count(name: str, value: int | None) -> None:
    """A count or a size (None: not given): at least 1."""
    if value is not None and value < 1:
        raise UsageError(f"{_named(name, value)}: must be at least 1")


def check_guidance(name: str, value: float) -> None:
    """A classifier-free guidance scale: finite and >= 0. 0 is the unconditional prediction, 1 the
    prompt's alone, more pushes towards the prompt; below 0 would push away from it."""
    if not math.isfinite(value) or value < 0:
        raise UsageError(
            f"{_named(name, value)}: guidance scales must be finite and >= 0 (1: the prompt's prediction "
            "alone, larger: guided towards the prompt)"
        )


def check_guidance_rescale(name: str, value: float | None) -> None:
    if value is not None and not 0 <= value <= 1:  # NaN fails both comparisons
        raise UsageError(
            f"{_named(name, value)}: must be between 0 and 1 (diffusers' guidance_rescale; 0.7 is usual)"
        )


def size_multiple_of(model) -> tuple[int, str]:
    """(what image sides must be multiples of, why in words): the VAE's factor, times the patch size
    for an mmdit model. A UNet takes any latent size (diffusers' UNet pads odd ones itself), but a
    side that is not a multiple of the VAE's factor is rounded down to one by sampling."""
    factor = model.vae_scale_factor
    family = of_model(model)
    if not family.patches:
        return factor, f"the VAE's factor {factor}"
    # Flux's transformer takes 1 x 1 patches of latents packed 2 x 2 (the family's `packing`).
    patch = patch_size(getattr(model, family.denoiser).config) * family.packing
    return factor * patch, f"the VAE's factor {factor} x the transformer's patch size {patch}"


def check_size(name: str, value: int | None, model) -> None:
    """`value` pixels (None: the model's own size) is a side `model` samples as asked, not rounded."""
    multiple, why = size_multiple_of(model)
    if value is None or value % multiple == 0:
        return
    below = value // multiple * multiple
    nearest = f"{below} or {below + multiple}" if below else str(multiple)
    raise UsageError(
        f"{_named(name, value)}: must be a multiple of {multiple} ({why}); the nearest valid sizes: {nearest}"
    )


def check_sampling_args(model, sizes: dict[str, int | None], rescale: tuple[str, float | None]) -> None:
    """What needs the loaded model: each of `sizes` ({flag: pixels}) against its factor, and that an
    mmdit model is given no guidance rescale (`rescale`: (flag, value))."""
    for name, value in sizes.items():
        check_size(name, value, model)
    name, value = rescale
    if value and not of_model(model).guidance_rescale:
        raise UsageError(
            f"{_named(name, value)}: an {of_model(model).name} model's flow sampling has no guidance rescale"
        )
