"""`build_model(preset, **options)`: a preset's architecture, optionally with pretrained components,
the objective options, and the speed/memory switches."""

import logging
import re
from pathlib import Path

import torch
from diffusers import AutoencoderKL, DDPMScheduler, UNet2DConditionModel
from transformers import CLIPTextModel, CLIPTextModelWithProjection, CLIPTokenizer

from compat.diffusers import AttnProcessor
from models.lora import add_lora, check_lora_options, drop_frozen_weights
from models.presets import PRESETS, build_components, family
from models.sharding import GRANULARITIES
from models.sharding import configure as configure_sharding
from models.sdxl import StableDiffusionXL
from models.stable_diffusion import StableDiffusion
from models.tokenizer import build_tokenizer

log = logging.getLogger(__name__)

# What `pretrained_components` may name, and the diffusers subfolder and class of each.
COMPONENTS = {
    "unet": ("unet", UNet2DConditionModel),
    "vae": ("vae", AutoencoderKL),
    "text_encoder": ("text_encoder", CLIPTextModel),
    "tokenizer": ("tokenizer", CLIPTokenizer),
    "scheduler": ("scheduler", DDPMScheduler),
    # SDXL's second text encoder and its tokenizer: named with their first ones (see _sdxl_pairs).
    "text_encoder_2": ("text_encoder_2", CLIPTextModelWithProjection),
    "tokenizer_2": ("tokenizer_2", CLIPTokenizer),
}
MODEL_CLASSES = {"sd": StableDiffusion, "sdxl": StableDiffusionXL}
_HUB_ID = re.compile(r"^[\w.-]+/[\w.-]+$")


def _check_source(pretrained: str) -> None:
    """A local folder must exist; anything else must look like a hub id (loaded when online)."""
    if Path(pretrained).expanduser().exists():
        return
    if _HUB_ID.match(pretrained) and not pretrained.startswith("."):
        log.info("model.pretrained=%s is not a local folder; loading it from the hub", pretrained)
        return
    raise FileNotFoundError(f"model.pretrained={pretrained}: no such folder (and not a hub id like org/name)")


def _load_component(name: str, pretrained: str):
    subfolder, cls = COMPONENTS[name]
    local = Path(pretrained).expanduser()
    if local.exists() and not (local / subfolder).is_dir():
        raise FileNotFoundError(f"model.pretrained={pretrained} has no '{subfolder}/' folder for the {name}")
    source = str(local) if local.exists() else pretrained
    return cls.from_pretrained(source, subfolder=subfolder)


def _sdxl_pairs(preset: str, components) -> list[str]:
    """`components` with text_encoder_2 / tokenizer_2 added for an SDXL preset wherever text_encoder /
    tokenizer is named: a diffusers SDXL folder holds both, and one without the other mixes models."""
    names = list(components)
    if family(preset) == "sdxl":
        for first in ("text_encoder", "tokenizer"):
            if first in names and f"{first}_2" not in names:
                names.append(f"{first}_2")
    return names


def _tokenizers(preset: str) -> dict:
    """The bundled BPE tokenizer(s) of a preset, each with its padding (models/tokenizer.py)."""
    spec = PRESETS[preset]
    tokenizers = {"tokenizer": build_tokenizer(pad_token=spec.get("pad_token", "!"))}
    if family(preset) == "sdxl":
        tokenizers["tokenizer_2"] = build_tokenizer(pad_token=spec["pad_token_2"])
    return tokenizers


def build_encoders(preset: str, pretrained: str | None = None) -> dict:
    """{vae, text_encoder, tokenizer} of `preset` (and text_encoder_2, tokenizer_2 for SDXL): loaded
    from `pretrained` (a diffusers folder or hub id), else with the preset's random weights. No UNet:
    what encoding a data set needs (`sd-convert latents`), without the seconds and 3.5 GB a random
    sd2 UNet costs."""
    if preset not in PRESETS:
        raise ValueError(f"unknown model preset {preset!r}; choose one of {sorted(PRESETS)}")
    names = _sdxl_pairs(preset, ("vae", "text_encoder", "tokenizer"))
    if pretrained is not None:
        _check_source(pretrained)
        return {name: _load_component(name, pretrained) for name in names}
    parts = build_components(preset, skip=("unet", "noise_scheduler"))
    parts.pop("latent_scale")
    return {**parts, **_tokenizers(preset)}


def build_model(
    preset: str,
    *,
    pretrained: str | None = None,
    pretrained_components: tuple[str, ...] | list[str] = ("unet", "vae", "text_encoder", "tokenizer"),
    prediction_type: str | None = None,
    offset_noise: float = 0.0,
    min_snr_gamma: float | None = None,
    zero_terminal_snr: bool = False,
    caption_drop_prob: float = 0.0,
    gradient_checkpointing: bool = False,
    channels_last: bool = False,
    attention: str = "sdpa",
    low_precision_norms: str | None = None,
    compile_unet: bool | dict = False,
    fsdp_wrap: str = "blocks",
    activation_checkpointing: str | None = None,
    lora: dict | None = None,
) -> StableDiffusion:
    """The ComposerModel for `preset` (a name in models.presets.PRESETS).

    pretrained: a diffusers-format folder (or hub id) to load `pretrained_components` from; the
        others keep the preset's random initialisation. The seed recipe loads the VAE and text
        encoder and trains the UNet from scratch: pretrained_components=[vae, text_encoder, tokenizer].
    prediction_type: "epsilon" or "v_prediction"; default: the preset's (sd2-768-v: v), else epsilon.
    zero_terminal_snr: rescale the betas so the last timestep is pure noise (Lin et al. 2023);
        needs v-prediction, since epsilon is not learnable at zero SNR.
    attention: "sdpa" (torch scaled_dot_product_attention, diffusers' default on torch 2) or
        "math" (the plain attention processor, for debugging or exotic devices).
    low_precision_norms: "amp_bf16" or "amp_fp16" to run the UNet's GroupNorm/LayerNorm in that
        precision with Composer's low-precision modules (only meaningful under that AMP precision).
    compile_unet: true to torch.compile the UNet, or a dict of torch.compile options, e.g.
        {mode: max-autotune} or {backend: aot_eager} (no C compiler needed; what the CPU tests use).
    fsdp_wrap, activation_checkpointing: the UNet's FSDP units ("unet", "blocks", "layers") and
        the ones recomputed in the backward pass under FSDP (None, "blocks", "layers"); see
        models/sharding.py.
    lora: {rank, alpha, target_modules, dropout} trains a peft LoRA adapter instead of the UNet
        (models/lora.py); needs every network from `pretrained`, and checkpoints hold the adapter only.
    """
    if preset not in PRESETS:
        raise ValueError(f"unknown model preset {preset!r}; choose one of {sorted(PRESETS)}")
    unknown = set(pretrained_components) - set(COMPONENTS)
    if family(preset) != "sdxl":
        unknown |= set(pretrained_components) & {"text_encoder_2", "tokenizer_2"}
    if unknown:
        raise ValueError(
            f"pretrained_components: unknown {sorted(unknown)}; choose from {sorted(COMPONENTS)}"
        )
    if attention not in ("sdpa", "math"):
        raise ValueError(f"attention={attention!r}; choose 'sdpa' or 'math'")
    for key, value in (("fsdp_wrap", fsdp_wrap), ("activation_checkpointing", activation_checkpointing)):
        if value is not None and value not in GRANULARITIES:
            raise ValueError(f"{key}={value!r}; choose one of {GRANULARITIES}")

    pretrained_components = _sdxl_pairs(preset, pretrained_components)
    if lora is not None:
        lora = check_lora_options(lora, pretrained, pretrained_components)

    # Components about to be loaded are not built (a random sd2 UNet takes seconds and 3.5 GB).
    loaded = [("noise_scheduler" if name == "scheduler" else name) for name in pretrained_components]
    parts = build_components(preset, skip=loaded if pretrained is not None else ())
    if pretrained is None or "tokenizer" not in pretrained_components:
        parts.update(_tokenizers(preset))
    if pretrained is not None:
        _check_source(pretrained)
        for name in pretrained_components:
            key = "noise_scheduler" if name == "scheduler" else name
            parts[key] = _load_component(name, pretrained)
            log.info("loaded %s from %s", name, pretrained)
        if "vae" in pretrained_components:  # the latent scale belongs to the VAE it was measured on
            parts["latent_scale"] = parts["vae"].config.scaling_factor
        if "scheduler" in pretrained_components and prediction_type is None:  # e.g. SD2-768's v
            prediction_type = parts["noise_scheduler"].config.get("prediction_type", "epsilon")
    prediction_type = prediction_type or PRESETS[preset].get("prediction_type", "epsilon")
    if zero_terminal_snr and prediction_type != "v_prediction":
        raise ValueError(
            "zero_terminal_snr needs prediction_type=v_prediction (epsilon is undefined at SNR 0)"
        )
    if zero_terminal_snr:
        # Lin et al. 2023: rescaled betas (the last step is pure noise) and samplers that start at
        # that last step ("trailing" spacing); their guidance rescale is generate()'s option.
        parts["noise_scheduler"] = DDPMScheduler.from_config(
            parts["noise_scheduler"].config, rescale_betas_zero_snr=True, timestep_spacing="trailing"
        )

    unet = parts["unet"]
    if lora is not None:
        add_lora(unet, **lora)
    if attention == "math":
        unet.set_attn_processor(AttnProcessor())
    if gradient_checkpointing:
        unet.enable_gradient_checkpointing()
    if channels_last:
        unet.to(memory_format=torch.channels_last)
    if low_precision_norms is not None:
        from composer.algorithms.low_precision_groupnorm import apply_low_precision_groupnorm
        from composer.algorithms.low_precision_layernorm import apply_low_precision_layernorm
        from composer.core import Precision

        apply_low_precision_groupnorm(unet, Precision(low_precision_norms))
        apply_low_precision_layernorm(unet, Precision(low_precision_norms))
    configure_sharding(unet, fsdp_wrap, activation_checkpointing)
    if compile_unet:
        # In place (nn.Module.compile), not torch.compile(unet): a wrapper would rename every
        # weight to `_orig_mod.*` in checkpoints, EMA and export.
        unet.compile(**(compile_unet if isinstance(compile_unet, dict) else {}))

    model = MODEL_CLASSES[family(preset)](
        prediction_type=prediction_type,
        offset_noise=offset_noise,
        min_snr_gamma=min_snr_gamma,
        caption_drop_prob=caption_drop_prob,
        **parts,
    )
    if lora is not None:
        model.register_state_dict_post_hook(drop_frozen_weights)
    # For the checkpoint's model record (models/record.py).
    model.preset = preset
    model.tokenizer_source = pretrained if pretrained and "tokenizer" in pretrained_components else None
    model.pretrained = (
        {"source": pretrained, "components": list(pretrained_components)} if pretrained else None
    )
    model.lora = lora
    return model
