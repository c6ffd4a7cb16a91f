"""What a checkpoint must say to rebuild its model without flags: the model record.

`describe(model)` gives the model family ("sd", "sdxl" or "mmdit": which class
models.build.MODEL_CLASSES builds), the full component configs (UNet, VAE, text encoder; SDXL's
text_encoder_2 too), each tokenizer's source and padding, the noise-schedule config,
`prediction_type`, `zero_terminal_snr`, the latent scale and the preset name, as plain Python values.
An "mmdit" record (models/mmdit.py) has the transformer's config in place of the UNet's, both CLIP
encoders (each with its projection), the flow-matching scheduler's config, the latent shift,
`t5_tokens` and the rectified-flow options (timestep_mean, timestep_std, timestep_shift as given:
None for the scheduler's `shift`, a number or "auto", and loss_weighting); with T5, its config and
the folder its tokenizer came from (T5's weights are in the checkpoint, its sentencepiece tokenizer
is not). `ModelRecord`, a Composer callback that the recipes add to every run, writes it into every
checkpoint (`state["callbacks"]["ModelRecord"]`); `read_record(state)` gets it back and
`rebuild(record)` builds that architecture. The weights come from the checkpoint, so `rebuild` can
run under `init_empty_weights` (no random init).

A resumed run whose model differs from its checkpoint's record in what it predicts, in its noise
schedule or in its rectified-flow timestep options (a timestep_shift of None compared as the
scheduler's shift it stands for) is warned about: the checkpoint would be resumed with a different
objective. So is one whose `param_dtype` differs: the optimizer's class differs too
(extensions/master_weights.py), and Composer then restores no optimizer state.
"""

import logging
from pathlib import Path

from composer.core import Callback
from diffusers import (
    AutoencoderKL,
    DDPMScheduler,
    FlowMatchEulerDiscreteScheduler,
    SD3Transformer2DModel,
    UNet2DConditionModel,
)
from transformers import (
    CLIPTextConfig,
    CLIPTextModel,
    CLIPTextModelWithProjection,
    CLIPTokenizer,
    T5Config,
    T5EncoderModel,
    T5TokenizerFast,
)

from models.presets import PRESETS, bundled_t5
from models.tokenizer import build_t5_tokenizer, build_tokenizer

log = logging.getLogger(__name__)

# The record version per family, so that code reading fewer families refuses a record it cannot
# rebuild by name: an SD record is version 1 (what SD-only code reads); an SDXL record is version 2
# (a `family` and the second text encoder and tokenizer: SD-only code would rebuild an SD model
# without the second encoder); an mmdit record is version 3 (a transformer, no UNet).
VERSIONS = {"sd": 1, "sdxl": 2, "mmdit": 3}
# An autoencoder run's record (a `<preset>-vae` preset, models/autoencoder.py): family "vae", its
# preset and VAE config. Not in VERSIONS: nothing samples with it, so `rebuild` refuses it.
AUTOENCODER_VERSION = 1
# The rectified-flow options an mmdit record keeps (models/mmdit.py), besides t5_tokens.
FLOW_OPTIONS = ("timestep_mean", "timestep_std", "timestep_shift", "loss_weighting")


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
    """The record's model family, "sd", "sdxl" or "mmdit"; records written before SDXL have none and
    are SD."""
    return record.get("family", "sd")


def describe(model) -> dict:
    """The record of a StableDiffusion, StableDiffusionXL or RectifiedFlowTransformer model (see the
    module docstring), or of an Autoencoder (family "vae": its preset and VAE config)."""
    from models.autoencoder import Autoencoder

    if isinstance(model, Autoencoder):
        return {
            "version": AUTOENCODER_VERSION,
            "family": "vae",
            "preset": getattr(model, "preset", None),
            "vae": _plain(model.vae.config),
        }
    scheduler = _plain(model.noise_scheduler.config)
    family = model_family(model)
    source = getattr(model, "tokenizer_source", None)
    record = {
        "version": VERSIONS[family],
        "family": family,
        "preset": getattr(model, "preset", None),
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
        # The dtype the denoiser trained in (model.param_dtype): "float32", or "bfloat16" with fp32
        # masters in the optimizer state. `rebuild` builds fp32 whatever it is (models/export.py).
        "param_dtype": str(model.denoiser_dtype).removeprefix("torch."),
    }
    if family == "mmdit":
        record["transformer"] = _plain(model.transformer.config)
        record["latent_shift"] = float(model.latent_shift)
        record["t5_tokens"] = model.t5_tokens
        record.update({key: getattr(model, key) for key in FLOW_OPTIONS})
        record["text_encoder_3"] = record["tokenizer_3"] = None
        if model.text_encoder_3 is not None:
            record["text_encoder_3"] = model.text_encoder_3.config.to_dict()
            record["tokenizer_3"] = {"source": _t5_source(model)}
    else:
        record["unet"] = _plain(model.unet.config)
    if family == "sdxl":  # what its unconditional branch is (models/sdxl.py)
        record["force_zeros_for_empty_prompt"] = model.force_zeros_for_empty_prompt
    if family in ("sdxl", "mmdit"):  # loaded from the same folder as the first (models.build._partners)
        record["text_encoder_2"] = model.text_encoder_2.config.to_dict()
        record["tokenizer_2"] = {"source": source, "pad_token": str(model.tokenizer_2.pad_token)}
    return record


def _t5_source(model) -> str | None:
    """The folder (or hub id) T5's tokenizer came from: the run's model.pretrained, which T5 only ever
    loads from (models.build), or the source of the record a model was rebuilt from."""
    pretrained = getattr(model, "pretrained", None)
    if pretrained and "tokenizer_3" in pretrained.get("components", ()):
        return pretrained["source"]
    return getattr(model, "tokenizer_3_source", None) or model.tokenizer_3.name_or_path or None


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
    if family == "mmdit":
        return _rebuild_mmdit(record)
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
        parts["force_zeros_for_empty_prompt"] = record.get("force_zeros_for_empty_prompt", True)
    return parts


def _rebuild_mmdit(record: dict) -> dict:
    """RectifiedFlowTransformer's components and options; T5 (when the record has it) with its
    tokenizer from the folder the run loaded it from."""
    parts = dict(
        transformer=SD3Transformer2DModel.from_config(record["transformer"]),
        vae=AutoencoderKL.from_config(record["vae"]),
        # Both CLIPs with their projections: the pooled vector is both projected outputs.
        text_encoder=CLIPTextModelWithProjection(CLIPTextConfig.from_dict(record["text_encoder"])),
        tokenizer=_tokenizer(record["tokenizer"], "tokenizer"),
        text_encoder_2=CLIPTextModelWithProjection(CLIPTextConfig.from_dict(record["text_encoder_2"])),
        tokenizer_2=_tokenizer(record["tokenizer_2"], "tokenizer_2"),
        noise_scheduler=FlowMatchEulerDiscreteScheduler.from_config(record["scheduler"]),
        latent_scale=record["latent_scale"],
        latent_shift=record["latent_shift"],
        t5_tokens=record["t5_tokens"],
        **{key: record[key] for key in FLOW_OPTIONS},
    )
    if record.get("text_encoder_3") is not None:
        parts["text_encoder_3"] = T5EncoderModel(T5Config.from_dict(record["text_encoder_3"]))
        parts["tokenizer_3"] = _t5_tokenizer(record["tokenizer_3"]["source"], record.get("preset"))
    return parts


def _t5_tokenizer(source: str | None, preset: str | None = None) -> T5TokenizerFast:
    if not source and preset in PRESETS and bundled_t5(preset):  # mmdit-tiny-t5's, built offline
        return build_t5_tokenizer()
    if not source:
        raise FileNotFoundError(
            "the model record has T5 (text_encoder_3) but not where its tokenizer came from: T5's "
            "weights are in the checkpoint, its tokenizer is not"
        )
    try:
        return T5TokenizerFast.from_pretrained(source, subfolder="tokenizer_3", local_files_only=True)
    except OSError as error:  # the folder is gone, or a hub id that is not in the local cache
        raise FileNotFoundError(
            f"the checkpoint's model reads T5, whose tokenizer came from {source}/tokenizer_3: not found "
            "there (T5's weights are in the checkpoint, its tokenizer is not); put that folder back"
        ) from error


def rebuild_model(record: dict):
    """The model `record` describes (its class from the family), with `preset` and `tokenizer_source`
    set as models.build sets them; weights as `rebuild`'s."""
    from models.build import MODEL_CLASSES

    model = MODEL_CLASSES[record_family(record)](**rebuild(record))
    model.preset, model.tokenizer_source = record.get("preset"), record["tokenizer"].get("source")
    if record.get("tokenizer_3"):
        model.tokenizer_3_source = record["tokenizer_3"]["source"]
    return model


def autoencoder_preset(state: dict) -> str | None:
    """The `<preset>-vae` preset when `state` is an autoencoder run's checkpoint (a VAE alone: no
    denoiser to sample with or export), by its record or, in one written before autoencoder runs
    recorded theirs, by its tensors (the VAE's and the latent variance); else None."""
    record = read_record(state)
    if record is not None:
        return (record.get("preset") or "a -vae preset") if record_family(record) == "vae" else None
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
        return self.record

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
    (models/mmdit.py: RectifiedFlowTransformer.shift_for)."""
    value = record.get(key)
    if key == "param_dtype":  # records written before it trained fp32
        return value or "float32"
    if key == "timestep_shift" and value is None and record_family(record) == "mmdit":
        return (record.get("scheduler") or {}).get("shift", 1.0)
    return value
