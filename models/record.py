"""What a checkpoint must say to rebuild its model without flags: the model record.

`describe(model)` gives the model family ("sd" or "sdxl": which class models.build.MODEL_CLASSES
builds), the full component configs (UNet, VAE, text encoder; SDXL's text_encoder_2 too), each
tokenizer's source and padding, the noise-schedule config, `prediction_type`, `zero_terminal_snr`,
the latent scale and the preset name, as plain Python values. `ModelRecord`, a Composer callback that the
recipes add to every run, writes it into every checkpoint (`state["callbacks"]["ModelRecord"]`);
`read_record(state)` gets it back and `rebuild(record)` builds that architecture. The weights come
from the checkpoint, so `rebuild` can run under `init_empty_weights` (no random init).

A resumed run whose model differs from its checkpoint's record in what it predicts or in its noise
schedule is warned about: the checkpoint would be resumed with a different objective.
"""

import logging
from pathlib import Path

from composer.core import Callback
from diffusers import AutoencoderKL, DDPMScheduler, UNet2DConditionModel
from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection, CLIPTokenizer

from models.tokenizer import build_tokenizer

log = logging.getLogger(__name__)

# The record version per family. An SD record is version 1, as before SDXL (code of that time still
# reads it); an SDXL record is version 2 (a `family` and the second text encoder and tokenizer), which
# that code refuses by name rather than rebuilding an SD model without the second encoder.
VERSIONS = {"sd": 1, "sdxl": 2}


def _plain(config) -> dict:
    """A diffusers FrozenDict / transformers config dict as plain values (tuples become lists)."""
    return {k: list(v) if isinstance(v, tuple) else v for k, v in dict(config).items()}


def model_family(model) -> str:
    """The key of models.build.MODEL_CLASSES whose class `model` is (the most derived one)."""
    from models.build import MODEL_CLASSES

    matches = [name for name, cls in MODEL_CLASSES.items() if isinstance(model, cls)]
    if not matches:
        raise TypeError(f"{type(model).__name__} is none of {sorted(MODEL_CLASSES)}'s classes")
    return max(matches, key=lambda name: len(MODEL_CLASSES[name].__mro__))


def record_family(record: dict) -> str:
    """The record's model family, "sd" or "sdxl"; records written before SDXL have none and are SD."""
    return record.get("family", "sd")


def describe(model) -> dict:
    """The record of a StableDiffusion or StableDiffusionXL model (see the module docstring)."""
    scheduler = _plain(model.noise_scheduler.config)
    family = model_family(model)
    source = getattr(model, "tokenizer_source", None)
    record = {
        "version": VERSIONS[family],
        "family": family,
        "preset": getattr(model, "preset", None),
        "unet": _plain(model.unet.config),
        "vae": _plain(model.vae.config),
        "text_encoder": model.text_encoder.config.to_dict(),
        "tokenizer": {"source": source, "pad_token": str(model.tokenizer.pad_token)},
        "scheduler": scheduler,
        "prediction_type": model.prediction_type,
        "zero_terminal_snr": bool(scheduler.get("rescale_betas_zero_snr", False)),
        "latent_scale": float(model.latent_scale),
        # Where the pretrained components came from; a LoRA checkpoint needs them back (its weights
        # are the adapter only).
        "pretrained": getattr(model, "pretrained", None),
        "lora": getattr(model, "lora", None),
    }
    if family == "sdxl":  # loaded from the same folder as the first (models.build._sdxl_pairs)
        record["text_encoder_2"] = model.text_encoder_2.config.to_dict()
        record["tokenizer_2"] = {"source": source, "pad_token": str(model.tokenizer_2.pad_token)}
    return record


def _tokenizer(entry: dict, subfolder: str) -> CLIPTokenizer:
    source = entry.get("source")
    if source and (Path(source) / subfolder).is_dir():
        return CLIPTokenizer.from_pretrained(source, subfolder=subfolder, local_files_only=True)
    # The bundled BPE (models/tokenizer.py) is the same vocabulary; only the padding differs.
    return build_tokenizer(pad_token=entry["pad_token"])


def rebuild(record: dict) -> dict:
    """The components and options of `MODEL_CLASSES[record_family(record)](...)` for `record`
    (models.build.MODEL_CLASSES); weights are random (or empty under `init_empty_weights`) until a
    state dict is loaded."""
    family = record_family(record)
    if family not in VERSIONS:
        raise ValueError(f"model record of family {family!r}; this code reads {sorted(VERSIONS)}")
    if record.get("version") != VERSIONS[family]:
        raise ValueError(
            f"model record version {record.get('version')!r}; this code reads version {VERSIONS[family]} "
            f"for family {family!r}"
        )
    parts = dict(
        unet=UNet2DConditionModel.from_config(record["unet"]),
        vae=AutoencoderKL.from_config(record["vae"]),
        text_encoder=CLIPTextModel(CLIPTextConfig.from_dict(record["text_encoder"])),
        tokenizer=_tokenizer(record["tokenizer"], "tokenizer"),
        noise_scheduler=DDPMScheduler.from_config(record["scheduler"]),
        latent_scale=record["latent_scale"],
        prediction_type=record["prediction_type"],
    )
    if family == "sdxl":
        config = CLIPTextConfig.from_dict(record["text_encoder_2"])
        parts["text_encoder_2"] = CLIPTextModelWithProjection(config)
        parts["tokenizer_2"] = _tokenizer(record["tokenizer_2"], "tokenizer_2")
    return parts


def rebuild_model(record: dict):
    """The model `record` describes (its class from the family), with `preset` and `tokenizer_source`
    set as models.build sets them; weights as `rebuild`'s."""
    from models.build import MODEL_CLASSES

    model = MODEL_CLASSES[record_family(record)](**rebuild(record))
    model.preset, model.tokenizer_source = record.get("preset"), record["tokenizer"].get("source")
    return model


def read_record(state: dict) -> dict | None:
    """The record in a Composer checkpoint's `state`, or None for checkpoints written before it."""
    return (state.get("callbacks") or {}).get(ModelRecord.__qualname__)


class ModelRecord(Callback):
    """Writes `describe(model)` into every checkpoint (Composer saves each callback's state_dict)."""

    def __init__(self, record: dict):
        self.record = record

    def state_dict(self) -> dict:
        return self.record

    def load_state_dict(self, state: dict) -> None:
        for key in ("prediction_type", "zero_terminal_snr"):
            if state.get(key) != self.record.get(key):
                log.warning(
                    "resuming a checkpoint recorded with %s=%r into a model with %s=%r",
                    key,
                    state.get(key),
                    key,
                    self.record.get(key),
                )
