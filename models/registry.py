"""The families, and the only list of them: a family folder under models/families/ declares its
`Family` (models/engine/family.py) in its family.py and registers with one line here. Everything that
differs between families is read from those declarations (`of(preset)`, `of_model(model)`,
`of_record(record)`); code elsewhere never compares a family's name.

PRESETS joins the families' presets (each family folder's presets.py says where its numbers come
from): a plain dict from name to the component configs. Weights are random: presets build
architectures, not checkpoints.
"""

import torch

from models.engine.family import OPTIONAL, Family
from models.families.flux.family import FAMILY as FLUX
from models.families.flux2.family import FAMILY as FLUX2
from models.families.mmdit.family import FAMILY as MMDIT
from models.families.sd.family import FAMILY as SD
from models.families.sdxl.family import FAMILY as SDXL
from models.families.zimage.family import FAMILY as ZIMAGE

FAMILIES = {family.name: family for family in (SD, SDXL, MMDIT, FLUX, ZIMAGE, FLUX2)}
PRESETS = {name: spec for family in FAMILIES.values() for name, spec in family.presets.items()}
MODEL_CLASSES = {name: family.model_class for name, family in FAMILIES.items()}


def family(preset: str) -> str:
    """The name of `preset`'s family (which model class it builds)."""
    return PRESETS[preset].get("family", "sd")


def of(preset: str) -> Family:
    """`preset`'s family."""
    return FAMILIES[family(preset)]


def of_model(model) -> Family:
    """The family whose model class `model` is (the most derived one: an SDXL model is an SD model)."""
    matches = [f for f in FAMILIES.values() if isinstance(model, f.model_class)]
    if not matches:
        raise TypeError(f"{type(model).__name__} is none of {sorted(FAMILIES)}'s classes")
    return max(matches, key=lambda f: len(f.model_class.__mro__))


def of_record(record: dict) -> str:
    """The name of a model record's family; records written before SDXL have none and are SD."""
    return record.get("family", "sd")


def presets_of(family: Family) -> list[str]:
    """The presets of `family`, in PRESETS' order."""
    return [preset for preset in PRESETS if of(preset) is family]


def of_components(names, pipeline: str | None = None) -> Family:
    """The family whose networks are all among `names` (a folder's subfolders, a state dict's
    prefixes), the one with the most of them: with a second text encoder SDXL rather than SD. A
    folder's pipeline class (`pipeline`, model_index.json's `_class_name`) names it outright: SD3's and
    Flux's networks have the same names."""
    named = [f for f in FAMILIES.values() if f.pipeline.__name__ == pipeline]
    if named:
        return named[0]
    names = set(names)
    fits = [f for f in FAMILIES.values() if _networks(f) <= names]
    return max(fits, key=lambda f: len(_networks(f)), default=FAMILIES["sd"])


def _networks(family: Family) -> set[str]:
    return {n for n, cls in family.components.items() if n not in OPTIONAL and _is_network(cls)}


def _is_network(cls) -> bool:
    return issubclass(cls, torch.nn.Module)


def preset_options(preset: str) -> dict:
    """The options a preset gives its model besides its components and the objective's (models.build)."""
    return {key: PRESETS[preset][key] for key in ("t5_tokens", "text_tokens") if key in of(preset).options}
