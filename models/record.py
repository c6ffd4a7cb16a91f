"""What a checkpoint must say to rebuild its model without flags: the model record.

`describe(model)` gives the full component configs (UNet, VAE, text encoder), the tokenizer's
source and padding, the noise-schedule config, `prediction_type`, `zero_terminal_snr`, the latent
scale and the preset name, as plain Python values. `ModelRecord`, a Composer callback that the
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
from transformers import CLIPTextConfig, CLIPTextModel, CLIPTokenizer

from models.tokenizer import build_tokenizer

log = logging.getLogger(__name__)

VERSION = 1


def _plain(config) -> dict:
    """A diffusers FrozenDict / transformers config dict as plain values (tuples become lists)."""
    return {k: list(v) if isinstance(v, tuple) else v for k, v in dict(config).items()}


def describe(model) -> dict:
    """The record of a StableDiffusion model (see the module docstring)."""
    scheduler = _plain(model.noise_scheduler.config)
    return {
        "version": VERSION,
        "preset": getattr(model, "preset", None),
        "unet": _plain(model.unet.config),
        "vae": _plain(model.vae.config),
        "text_encoder": model.text_encoder.config.to_dict(),
        "tokenizer": {
            "source": getattr(model, "tokenizer_source", None),
            "pad_token": str(model.tokenizer.pad_token),
        },
        "scheduler": scheduler,
        "prediction_type": model.prediction_type,
        "zero_terminal_snr": bool(scheduler.get("rescale_betas_zero_snr", False)),
        "latent_scale": float(model.latent_scale),
        # Where the pretrained components came from; a LoRA checkpoint needs them back (its weights
        # are the adapter only).
        "pretrained": getattr(model, "pretrained", None),
        "lora": getattr(model, "lora", None),
    }


def rebuild(record: dict) -> dict:
    """The components and options of `StableDiffusion(...)` for `record`; weights are random (or
    empty under `init_empty_weights`) until a state dict is loaded."""
    if record.get("version") != VERSION:
        raise ValueError(f"model record version {record.get('version')!r}; this code reads version {VERSION}")
    source = record["tokenizer"].get("source")
    if source and (Path(source) / "tokenizer").is_dir():
        tokenizer = CLIPTokenizer.from_pretrained(source, subfolder="tokenizer", local_files_only=True)
    else:  # the bundled BPE (models/tokenizer.py) is the same vocabulary; only the padding differs
        tokenizer = build_tokenizer(pad_token=record["tokenizer"]["pad_token"])
    return dict(
        unet=UNet2DConditionModel.from_config(record["unet"]),
        vae=AutoencoderKL.from_config(record["vae"]),
        text_encoder=CLIPTextModel(CLIPTextConfig.from_dict(record["text_encoder"])),
        tokenizer=tokenizer,
        noise_scheduler=DDPMScheduler.from_config(record["scheduler"]),
        latent_scale=record["latent_scale"],
        prediction_type=record["prediction_type"],
    )


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
