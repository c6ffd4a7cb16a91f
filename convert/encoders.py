"""The frozen networks that `sd-convert latents` (convert/latents.py) encodes with: a preset's VAE and
text encoders without its denoiser, making the model's own calls, so precomputed latents stay what
training on the images would compute. One class for every family (its conditioner encodes), built by
`load_encoders` from a diffusers folder or from the preset's seeded random weights, or by
`recipe_encoders` from the model a run config trains (`--recipe`: its seed and `model:` section, so
a random text encoder is the one its training run draws, beside a VAE loaded from model.pretrained).
"""

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

import models.registry as families
from convert.common import ConvertError
from models.engine.family import OPTIONAL, T5_ENCODER, T5_TOKENIZER  # SD3's optional T5
from models.engine.latent_diffusion import LatentDiffusion
from models.presets import bundled_t5
from models.registry import PRESETS

log = logging.getLogger(__name__)


class Encoders:
    """The frozen VAE and a family's text encoders and tokenizers (its conditioner's `text_parts`, and an
    optional T5) without the denoiser. The family's conditioner (models/engine/conditioners.py) encodes with
    them, as the model does, and `vae_moments` is the model's own call, so precomputed latents stay what
    training on the images would compute."""

    vae_moments = LatentDiffusion.vae_moments

    def __init__(
        self,
        family,
        vae,
        *,
        t5_tokens=None,
        text_tokens=None,
        t5=None,
        t5_tokenizer=None,
        **text_parts,
    ):
        names = family.conditioner.text_parts
        if sorted(text_parts) != sorted(names):
            raise TypeError(
                f"the {family.name} family's encoders are {', '.join(names)}, not {sorted(text_parts)}"
            )
        if (t5 is None) != (t5_tokenizer is None):
            raise ValueError("a T5 and its tokenizer come together: give both or neither")
        if t5 is not None and not family.reads_t5:
            raise ValueError(f"the {family.name} family reads no T5 context")
        self.family, self.conditioner = family, family.conditioner
        self.micro_conditioning = family.micro_conditioning
        self.vae = vae
        for name, part in text_parts.items():
            setattr(self, name, part)
        # Under the model's component names, which the conditioner reads (SD3's text_encoder_3, ...).
        setattr(self, T5_ENCODER, t5)
        setattr(self, T5_TOKENIZER, t5_tokenizer)
        self.t5_tokens = None if t5_tokens is None else int(t5_tokens)
        self.text_tokens = None if text_tokens is None else int(text_tokens)  # an LLM's (Z-Image's)

    def to(self, device, dtype: torch.dtype | None = None) -> "Encoders":
        """On `device` (and cast to `dtype` when given), in eval mode."""
        for name in ("vae", T5_ENCODER, *self.conditioner.text_parts):
            part = getattr(self, name)
            if isinstance(part, torch.nn.Module):
                part.to(device=device, dtype=dtype).eval()
        return self


def has_t5(pretrained: str | None) -> bool:
    """Whether the diffusers folder (or hub id) `pretrained` holds a T5 encoder and its tokenizer
    (`text_encoder_3/`, `tokenizer_3/`, as stable-diffusion-3-medium-diffusers does)."""
    if pretrained is None:
        return False
    local = Path(pretrained).expanduser()
    if local.exists():
        return all((local / name).is_dir() for name in OPTIONAL)
    from huggingface_hub import hf_hub_download

    with open(hf_hub_download(pretrained, "model_index.json")) as index:
        parts = json.load(index)
    return all((parts.get(name) or [None])[0] is not None for name in OPTIONAL)


def load_encoders(preset: str, pretrained: str | None = None, t5: bool = False) -> Encoders:
    """`preset`'s encoders from `pretrained`, or its random weights drawn from seed 0, so that every
    process of a run (and every run) encodes with the same ones. With `t5`, an mmdit preset's T5
    from `pretrained` too (a `bundled_t5` preset's own random one without `pretrained`)."""
    from models.build import build_encoders
    from models.components import load_component

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        parts = build_encoders(preset, pretrained)
    family = families.of(preset)
    # A bundled_t5 preset's random T5 comes under its component names.
    roles = {"t5": parts.pop(T5_ENCODER, None), "t5_tokenizer": parts.pop(T5_TOKENIZER, None)}
    if t5 and family.reads_t5 and pretrained is not None:
        roles = {
            "t5": load_component(T5_ENCODER, pretrained, preset),
            "t5_tokenizer": load_component(T5_TOKENIZER, pretrained, preset),
        }
    return Encoders(family, **parts, **roles, **families.preset_options(preset))


ENCODER_PARTS = ("vae", "text_encoder", "tokenizer")


def missing_parts(preset: str, pretrained: str) -> list[str]:
    """The encoder folders (`vae/`, `text_encoder/`, `tokenizer/`, and SDXL's and SD3's second
    ones) that a local `pretrained` folder lacks; a hub id is not checked here."""
    from models.build import _partners

    local = Path(pretrained).expanduser()
    if not local.is_dir():
        return []
    return [name for name in _partners(preset, ENCODER_PARTS) if not (local / name).is_dir()]


@dataclass(frozen=True)
class RecipeModel:
    """What builds the model a run config (`sd-convert latents --recipe`) trains: its seed and its
    `model:` section as JSON (hashable, so an Encoder holding it stays a dict key)."""

    seed: int
    model: str  # json.dumps(run.model, sort_keys=True)

    @property
    def options(self) -> dict:
        return json.loads(self.model)


def recipe_model(yaml: str, overrides=()) -> RecipeModel:
    """The seed and `model:` section of the run config `yaml` with Hydra `overrides` (only `seed` and
    `model.*` ones: nothing else changes the encoders), composed as train.py composes it and checked
    as models.build would (a ConvertError on a mistake). Reads only: nothing is built. Hydra directly,
    not recipes.config: convert sits below recipes (tests/test_layers.py)."""
    import inspect

    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf import OmegaConf

    from models import MODELS
    from models.build import build_model, check_model_options

    path = Path(yaml).resolve()
    if not path.is_file():
        raise ConvertError(f"--recipe {yaml}: no such file")
    for override in overrides:
        key = override.split("=", 1)[0].lstrip("+~")
        if key != "seed" and not key.startswith("model."):
            raise ConvertError(
                f"{yaml}: unknown config key {key!r} here: only seed and model.* change the encoders"
            )
    try:
        with initialize_config_dir(config_dir=str(path.parent), version_base=None):
            cfg = compose(
                config_name=path.stem, overrides=[o if o[:1] in "+~" else f"++{o}" for o in overrides]
            )
        cfg = OmegaConf.to_container(cfg, resolve=True)
    except (HydraException, ValueError) as err:
        raise ConvertError(f"{yaml}: {' '.join(str(err).split())}") from err
    model, seed = cfg.get("model"), cfg.get("seed")
    if not isinstance(model, dict) or model.get("preset") not in MODELS or not isinstance(seed, int):
        raise ConvertError(f"{yaml}: not a run config with a seed and a model.preset of {sorted(MODELS)}")
    params = inspect.signature(MODELS[model["preset"]]).parameters
    if unknown := sorted(set(model) - set(params)):
        raise ConvertError(f"{yaml}: unknown config key 'model.{unknown[0]}'")
    if MODELS[model["preset"]] is build_model:
        try:
            check_model_options(**model)
        except (ValueError, TypeError) as err:
            raise ConvertError(f"{yaml}: {err}") from err
    return RecipeModel(seed, json.dumps(model, sort_keys=True))


def recipe_encoders(recipe: RecipeModel) -> Encoders:
    """The frozen encoders of the model the recipe trains, built as train.py builds it: after
    composer's `seed_all(seed)`, `models.build(**model)`, so random ones (the tiny recipes' text
    encoder) are the very weights its training run draws, and loaded ones come from its
    model.pretrained. The denoiser is dropped. The caller's random states are left as they were."""
    import random

    import numpy as np
    from composer.utils import reproducibility

    from models import build

    python_state, numpy_state = random.getstate(), np.random.get_state()
    try:
        with torch.random.fork_rng(devices=[]):
            reproducibility.seed_all(recipe.seed)
            model = build(**recipe.options)
    finally:
        random.setstate(python_state)
        np.random.set_state(numpy_state)
    return encoders_of(model)


def encoders_of(model) -> Encoders:
    """The VAE, text encoder(s) and tokenizer(s) of a model of any family, as Encoders (the same
    modules: the same outputs)."""
    family = families.of_model(model)
    parts = {name: getattr(model, name) for name in family.conditioner.text_parts}
    if family.reads_t5 and getattr(model, T5_ENCODER) is not None:
        parts.update(t5=getattr(model, T5_ENCODER), t5_tokenizer=getattr(model, T5_TOKENIZER))
    lengths = {key: getattr(model, key, None) for key in ("t5_tokens", "text_tokens")}
    return Encoders(family, model.vae, **lengths, **parts)


def check_encoder_flags(preset: str, pretrained: str | None, t5: bool) -> None:
    """`sd-convert latents`' --preset, --pretrained and --t5, checked before any input is read: a
    ConvertError naming the flag and the fix."""
    from models.build import check_pretrained

    if preset not in PRESETS:
        raise ConvertError(f"--preset {preset}: unknown; choose one of {sorted(PRESETS)}")
    if pretrained is not None:
        try:
            check_pretrained(pretrained)
        except FileNotFoundError as err:
            raise ConvertError(f"--pretrained {pretrained}: {err}") from None
        missing = missing_parts(preset, pretrained)
        if missing:
            raise ConvertError(
                f"--pretrained {pretrained} has no {', '.join(m + '/' for m in missing)} (a VAE-only export "
                "such as runs/tiny-vae/export?): give --recipe YAML instead, e.g. --recipe "
                "yamls/tiny-cpu.yaml, to encode with the VAE and text encoder that recipe trains with"
            )
    else:
        log.warning("no --pretrained: encoding with the %s preset's random weights", preset)
    family = families.of(preset)
    if t5 and not family.reads_t5:
        raise ConvertError(f"--t5: preset {preset!r} (family {family.name}) reads no T5 context")
    if t5 and bundled_t5(preset) and pretrained is not None and not has_t5(pretrained):
        raise ConvertError(
            f"--preset {preset} reads T5 and --pretrained {pretrained} has no text_encoder_3/ and "
            "tokenizer_3/: leave out --pretrained (the preset's random T5), or give --recipe YAML"
        )
    if t5 and not bundled_t5(preset) and not has_t5(pretrained):
        raise ConvertError(
            "--t5 needs --pretrained, a folder (or hub id) with text_encoder_3/ and tokenizer_3/"
        )
    if not t5 and family.reads_t5 and has_t5(pretrained):
        log.info(
            "--pretrained %s has a T5 (text_encoder_3); not storing its context without --t5", pretrained
        )


def recipe_settings(recipe: RecipeModel) -> tuple[str, str | None, bool]:
    """(preset, pretrained, t5) of the model a --recipe builds, checked: a recipe that trains a VAE
    alone (no text encoder) or whose model.pretrained is missing is a ConvertError."""
    from models.build import check_pretrained

    model = recipe.options
    preset, pretrained = model["preset"], model.get("pretrained")
    if preset.endswith("-vae"):
        raise ConvertError(
            f"--recipe: its model.preset is {preset}, a VAE alone (no text encoder): give the recipe that "
            "trains on its latents, e.g. yamls/tiny-cpu.yaml"
        )
    if pretrained is not None:
        try:
            check_pretrained(pretrained)
        except FileNotFoundError as err:
            raise ConvertError(
                f"--recipe: {err}; train.py makes it first when the recipe has prepare_pretrained "
                "(yamls/tiny-cpu.yaml: python train.py yamls/tiny-vae.yaml)"
            ) from None
    components = model.get("pretrained_components") or []
    loads_t5 = pretrained is not None and any(name in components for name in OPTIONAL)
    return preset, pretrained, (loads_t5 or bundled_t5(preset)) and families.of(preset).reads_t5
