"""What a checkpoint must say to rebuild its model without flags: the model record.

`describe(model)` gives the model family (a key of models.registry.FAMILIES, whose `record_version`
it carries), the full config of each of the family's networks (the denoiser, VAE, text encoders;
None for an optional one the model goes without, SD3's T5), each tokenizer's source (and a CLIP
tokenizer's padding), the noise-schedule config, `prediction_type`, `zero_terminal_snr`, the latent
scale, the preset name and the family's `options` (SDXL's force_zeros_for_empty_prompt; an mmdit
model's latent shift, `t5_tokens` and rectified-flow options: timestep_shift as given, None for the
scheduler's `shift`, a number or "auto"), as plain Python values. T5's weights are in the
checkpoint, its sentencepiece tokenizer is not: the record names the folder it came from.
`ModelRecord`, a Composer callback that the recipes add to every run, writes it into every
checkpoint (`state["callbacks"]["ModelRecord"]`); `read_record(state)` gets it back and
`rebuild(record)` builds that architecture. The weights come from the checkpoint, so `rebuild` can
run under `init_empty_weights` (no random init).

A resumed run whose model differs from its checkpoint's record in what it predicts, in its noise
schedule or in its rectified-flow timestep options (a timestep_shift of None compared as the
scheduler's shift it stands for) is warned about: the checkpoint would be resumed with a different
objective. So is one whose `param_dtype` differs: the optimizer's class differs too
(extensions/master_weights.py), and Composer then restores no optimizer state.
"""

import copy
import logging
from pathlib import Path

import torch
from composer.core import Callback
from transformers import CLIPTokenizer, PreTrainedModel, T5TokenizerFast

from models.engine.family import FLOW_OPTIONS, REQUIRED, construct
from models.engine.tokenizer import build_t5_tokenizer, build_tokenizer
from models.presets import bundled_t5
from models.registry import FAMILIES, PRESETS, of_model, of_record

log = logging.getLogger(__name__)

# The record version per family (models.registry: record_version), so that code reading fewer
# families refuses a record it cannot rebuild by name.
VERSIONS = {name: family.record_version for name, family in FAMILIES.items()}
# An autoencoder run's record (a `<preset>-vae` preset, models/autoencoder.py): family "vae", its
# preset and VAE config. Not in VERSIONS: nothing samples with it, so `rebuild` refuses it.
AUTOENCODER_VERSION = 1
AUTOENCODER = "vae"  # an autoencoder record's `family`: none of models.registry's


def _plain(config) -> dict:
    """A diffusers FrozenDict / transformers config dict as plain values (tuples become lists)."""
    return {k: list(v) if isinstance(v, tuple) else v for k, v in dict(config).items()}


def _config(module) -> dict:
    """A network's config as plain values: a transformers model's dict, a diffusers model's."""
    return module.config.to_dict() if isinstance(module, PreTrainedModel) else _plain(module.config)


def _value(value):
    """A model option as a plain value (a latent shift is a tensor buffer)."""
    return float(value) if hasattr(value, "item") else value


def describe(model) -> dict:
    """The record of a StableDiffusion, StableDiffusionXL or RectifiedFlowTransformer model (see the
    module docstring), or of an Autoencoder (family AUTOENCODER: its preset and VAE config)."""
    from models.autoencoder import Autoencoder

    if isinstance(model, Autoencoder):
        return {
            "version": AUTOENCODER_VERSION,
            "family": AUTOENCODER,
            "preset": getattr(model, "preset", None),
            "vae": _plain(model.vae.config),
        }
    scheduler = _plain(model.noise_scheduler.config)
    family = of_model(model)
    source = getattr(model, "tokenizer_source", None)
    record = {
        "version": family.record_version,
        "family": family.name,
        "preset": getattr(model, "preset", None),
        "scheduler": scheduler,
        "prediction_type": model.prediction_type,
        "zero_terminal_snr": bool(scheduler.get("rescale_betas_zero_snr", False)),
        "latent_scale": float(model.latent_scale),
        # Where the pretrained components came from; a LoRA checkpoint needs them back (its weights
        # are the adapter only).
        "pretrained": getattr(model, "pretrained", None),
        "lora": getattr(model, "lora", None),
        # How a LoRA run stored its frozen base (model.base_weights: None, bf16, fp8, nf4).
        "base_weights": getattr(model, "base_weights", None),
        # The dtype the denoiser trained in (model.param_dtype): "float32", or "bfloat16" with fp32
        # masters in the optimizer state. `rebuild` builds fp32 whatever it is (models/export.py).
        "param_dtype": str(model.denoiser_dtype).removeprefix("torch."),
    }
    for name, cls in family.components.items():
        part = getattr(model, name, None) if name != "scheduler" else None
        if issubclass(cls, torch.nn.Module):
            record[name] = None if part is None else _config(part)
        elif issubclass(cls, T5TokenizerFast):  # where it came from (the CLIPs' are bundled BPE)
            record[name] = None if part is None else {"source": _t5_source(model, name)}
        elif name != "scheduler":
            record[name] = {"source": source, "pad_token": str(part.pad_token)}
    record.update({key: _value(getattr(model, key)) for key in family.options})
    return record


def _t5_source(model, name: str) -> str | None:
    """The folder (or hub id) T5's tokenizer (component `name`) came from: the run's model.pretrained,
    which T5 only ever loads from (models.build), or the source of the record a model was rebuilt from;
    None for one built offline (a `bundled_t5` preset's)."""
    pretrained = getattr(model, "pretrained", None)
    if pretrained and name in pretrained.get("components", ()):
        return pretrained["source"]
    return getattr(model, f"{name}_source", None) or getattr(model, name).name_or_path or None


def _tokenizer(entry: dict, subfolder: str) -> CLIPTokenizer:
    source = entry.get("source")
    if source and (Path(source) / subfolder).is_dir():
        return CLIPTokenizer.from_pretrained(source, subfolder=subfolder, local_files_only=True)
    # The bundled BPE (models/engine/tokenizer.py) is the same vocabulary; only the padding differs.
    return build_tokenizer(pad_token=entry["pad_token"])


def rebuild(record: dict) -> dict:
    """The components and options of the family's model class for `record` (models.registry); weights
    are random (or empty under `init_empty_weights`) until a state dict is loaded."""
    name = of_record(record)
    if name not in FAMILIES:
        raise ValueError(f"model record of family {name!r}; this code reads {sorted(VERSIONS)}")
    family = FAMILIES[name]
    if record.get("version") != family.record_version:
        raise ValueError(
            f"model record version {record.get('version')!r}; this code reads version "
            f"{family.record_version} for family {name!r}"
        )
    parts = {}
    for part, cls in family.components.items():
        if part == "scheduler":
            parts["noise_scheduler"] = cls.from_config(record["scheduler"])
        elif issubclass(cls, torch.nn.Module):
            if record.get(part) is not None:  # an optional one (T5) the model went without: None
                parts[part] = construct(cls, record[part], recorded=True)
        elif issubclass(cls, T5TokenizerFast):  # with its T5 (an optional one may be absent)
            if record.get(part.replace("tokenizer", "text_encoder")) is not None:
                parts[part] = _t5_tokenizer(record[part]["source"], record.get("preset"), part)
        elif cls is CLIPTokenizer:
            parts[part] = _tokenizer(record[part], part)
        else:  # an LLM's tokenizer (Z-Image's Qwen2Tokenizer)
            parts[part] = _other_tokenizer(cls, record[part], record.get("preset"), family, part)
    parts["latent_scale"] = record["latent_scale"]
    for key, default in family.options.items():
        parts[key] = record[key] if default is REQUIRED else record.get(key, default)
    return parts


def _other_tokenizer(cls, entry: dict, preset: str | None, family, subfolder: str):
    """A tokenizer neither CLIP's nor T5's: from the folder it came from, else the one a `bundled_text`
    preset builds offline (its conditioner's `offline_tokenizers`)."""
    source = entry.get("source")
    if source and (Path(source) / subfolder).is_dir():
        return cls.from_pretrained(source, subfolder=subfolder, local_files_only=True)
    if preset in PRESETS and PRESETS[preset].get("bundled_text"):
        return family.conditioner.offline_tokenizers()[subfolder]
    raise FileNotFoundError(
        f"the checkpoint's {subfolder} came from {source or 'an unrecorded folder'}: not found there (the "
        "text encoder's weights are in the checkpoint, its tokenizer is not); put that folder back"
    )


def _t5_tokenizer(source: str | None, preset: str | None, subfolder: str) -> T5TokenizerFast:
    if not source and preset in PRESETS and bundled_t5(preset):  # mmdit-tiny-t5's, built offline
        return build_t5_tokenizer()
    if not source:
        raise FileNotFoundError(
            f"the model record has T5 ({subfolder.replace('tokenizer', 'text_encoder')}) but not where its "
            "tokenizer came from: T5's weights are in the checkpoint, its tokenizer is not"
        )
    try:
        return T5TokenizerFast.from_pretrained(source, subfolder=subfolder, local_files_only=True)
    except OSError as error:  # the folder is gone, or a hub id that is not in the local cache
        raise FileNotFoundError(
            f"the checkpoint's model reads T5, whose tokenizer came from {source}/{subfolder}: not found "
            "there (T5's weights are in the checkpoint, its tokenizer is not); put that folder back"
        ) from error


def rebuild_model(record: dict):
    """The model `record` describes (its class from the family), with `preset` and `tokenizer_source`
    set as models.build sets them; weights as `rebuild`'s."""
    model = FAMILIES[of_record(record)].model_class(**rebuild(record))
    model.preset, model.tokenizer_source = record.get("preset"), record["tokenizer"].get("source")
    t5 = FAMILIES[of_record(record)].t5_tokenizer
    if t5 and record.get(t5):
        setattr(model, f"{t5}_source", record[t5]["source"])
    return model


def autoencoder_preset(state: dict) -> str | None:
    """The `<preset>-vae` preset when `state` is an autoencoder run's checkpoint (a VAE alone: no
    denoiser to sample with or export), by its record or, in one written before autoencoder runs
    recorded theirs, by its tensors (the VAE's and the latent variance); else None."""
    record = read_record(state)
    if record is not None:
        return (record.get("preset") or "a -vae preset") if record.get("family") == AUTOENCODER else None
    names = [name.removeprefix("module.") for name in state.get("model") or {}]
    if names and all(name.startswith("vae.") or name == "latent_var" for name in names):
        return "a -vae preset"
    return None


def read_record(state: dict) -> dict | None:
    """The record in a Composer checkpoint's `state`, or None for checkpoints written before it."""
    return (state.get("callbacks") or {}).get(ModelRecord.__qualname__)


class ModelRecord(Callback):
    """Writes `describe(model)` into every checkpoint (Composer saves each callback's state_dict)."""

    def __init__(self, record: dict):
        self.record = record

    def state_dict(self) -> dict:
        # A copy: a sharded checkpoint's load (torch distributed checkpoint) writes what it read into
        # the dict state_dict() gave it, with its keys made strings (id2label's 0 next to "0").
        return copy.deepcopy(self.record)

    def load_state_dict(self, state: dict) -> None:
        # FLOW_OPTIONS: None == None in the records of a UNet model, which have none.
        for key in ("prediction_type", "zero_terminal_snr", *FLOW_OPTIONS, "param_dtype"):
            if _setting(state, key) != _setting(self.record, key):
                log.warning(
                    "resuming a checkpoint recorded with %s=%r into a model with %s=%r",
                    key,
                    _setting(state, key),
                    key,
                    _setting(self.record, key),
                )


def _setting(record: dict, key: str):
    """The record's `key`; an mmdit record's timestep_shift None as the scheduler's shift it means
    (models/families/mmdit/model.py: RectifiedFlowTransformer.shift_for)."""
    value = record.get(key)
    if key == "param_dtype":  # records written before it trained fp32
        return value or "float32"
    family = FAMILIES.get(of_record(record))
    if key not in record and family is not None and family.options.get(key, REQUIRED) is not REQUIRED:
        return family.options[key]  # a record written before the option existed: its default
    if key == "timestep_shift" and value is None and family is not None and key in family.options:
        return (record.get("scheduler") or {}).get("shift", 1.0)
    return value
