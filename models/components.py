"""The one component loader: `build_components` (a preset's random weights), `load_component` (a
diffusers folder or hub id) and `load_folder` (an exported pipeline folder) over the family registry
(models/registry.py), as `models.checkpoints.record.rebuild` does for a checkpoint's record.
"""

import json
import logging
from pathlib import Path

import yaml
from diffusers.models.modeling_utils import ModelMixin

from models.engine.family import OPTIONAL, README, Family, construct
from models.presets import bundled_t5
from models.registry import PRESETS, of

log = logging.getLogger(__name__)

# The T5 length of an SD3 folder that does not say its own (no README.md of models.export): SD3's.
SD3_T5_TOKENS = 77


def build_components(preset: str, skip: tuple[str, ...] | list[str] = ()) -> dict:
    """The denoiser, VAE, text encoder(s) and noise scheduler of a preset (its family's `components`),
    with random weights, and its latent scale (and shift); the components named in `skip` (e.g. those
    about to be loaded from a pretrained folder) are left out. An OPTIONAL component (SD3's T5) is
    built only when the preset has `bundled_t5`; else it only loads from a folder."""
    if preset not in PRESETS:
        raise ValueError(f"unknown model preset {preset!r}; choose one of {sorted(PRESETS)}")
    spec = PRESETS[preset]
    parts = {}
    for name, cls in of(preset).components.items():
        key = "noise_scheduler" if name == "scheduler" else name
        if name.startswith("tokenizer") or key in skip or name not in spec:
            continue  # tokenizers: models.build.bundled_tokenizers
        if name in OPTIONAL and not bundled_t5(preset):
            continue
        # A preset whose network is another class than its family's (FLUX.2-dev's Mistral 3 text encoder).
        parts[key] = construct(spec.get("component_classes", {}).get(name, cls), spec[name])
    return {**parts, **{key: spec[key] for key in ("latent_scale", "latent_shift") if key in spec}}


def load_component(name: str, pretrained: str, preset: str, **kwargs):
    """Component `name` of `preset`'s family from the diffusers folder or hub id `pretrained`."""
    cls = of(preset).components[name]
    local = Path(pretrained).expanduser()
    if local.exists() and not (local / name).is_dir():
        raise FileNotFoundError(f"model.pretrained={pretrained} has no '{name}/' folder for the {name}")
    source = str(local) if local.exists() else pretrained
    return cls.from_pretrained(source, subfolder=name, **kwargs)


def load_folder(folder: Path, family: Family) -> dict:
    """The components and options of `family`'s model from an exported pipeline folder (an
    OPTIONAL component when the folder has it)."""
    parts = {}
    for name, cls in family.components.items():
        if name in OPTIONAL and not (folder / name).is_dir():
            continue
        local = dict(local_files_only=True)
        # Without `accelerate` installed diffusers cannot skip the random init; saying so explicitly
        # silences its warning about it.
        if issubclass(cls, ModelMixin):
            local["low_cpu_mem_usage"] = False
        if name == "scheduler":  # a saved sampler's config (DDIM) as the training schedule
            parts["noise_scheduler"] = cls.from_config(cls.load_config(folder, subfolder=name, **local))
        else:
            parts[name] = cls.from_pretrained(folder, subfolder=name, **local)
    return {**parts, **folder_options(family, folder, parts)}


def folder_options(family: Family, folder: Path, parts: dict) -> dict:
    """`family`'s model's options from an exported pipeline folder whose components are `parts`."""
    # A VAE without a scalar scale (FLUX.2's normalises by its batch-norm statistics) scales by 1.
    options = {"latent_scale": parts["vae"].config.get("scaling_factor", 1.0)}
    if "prediction_type" in family.options:
        options["prediction_type"] = parts["noise_scheduler"].config.get("prediction_type", "epsilon")
    # SDXL's unconditional branch (models/families/sdxl/model.py)
    if "force_zeros_for_empty_prompt" in family.options:
        index = json.loads((folder / "model_index.json").read_text())
        options["force_zeros_for_empty_prompt"] = index.get("force_zeros_for_empty_prompt", True)
    if "latent_shift" in family.options:
        options["latent_shift"] = parts["vae"].config.get("shift_factor") or 0.0
    for key in ("t5_tokens", "text_tokens"):  # the text encoder's length: T5's, an LLM's (Z-Image's)
        if key in family.options:
            options[key] = _t5_tokens(folder)
    return options


def _t5_tokens(folder: Path) -> int:
    """max_sequence_length from the front matter of the folder's README.md, else SD3's 77."""
    card = folder / README
    if card.is_file():
        text = card.read_text()
        if text.startswith("---\n"):
            front = yaml.safe_load(text[4 : text.find("\n---", 4)]) or {}
            if isinstance(front, dict) and isinstance(front.get("max_sequence_length"), int):
                return front["max_sequence_length"]
    log.info(
        "%s: no max_sequence_length in a README.md front matter; the T5 part of the context is %d tokens "
        "(SD3's)",
        folder,
        SD3_T5_TOKENS,
    )
    return SD3_T5_TOKENS
