"""`build_model(preset, **options)`: a preset's architecture, optionally with pretrained components,
the objective options, and the speed/memory switches."""

import inspect
import json
import logging
import re
from pathlib import Path

import torch
from diffusers import DDPMScheduler

import models.registry as families
from compat.diffusers import AttnProcessor
from models.build_checks import PARAM_DTYPES, checked
from models.components import build_components, load_component
from models.engine.family import FLOW_OPTIONS
from models.engine.tokenizer import build_t5_tokenizer, build_tokenizer
from models.families.mmdit.model import RectifiedFlowTransformer
from models.families.sd.model import StableDiffusion
from models.presets import bundled_t5, denoiser_name
from models.registry import PRESETS
from models.training.base_weights import add_adapter_over, store_base
from models.training.fp8 import convert_to_fp8, fp8_recipe
from models.training.lora import drop_frozen_weights
from models.training.lora_layouts import start_from
from models.training.sharding import configure as configure_sharding
from models.training.torch_compile import compile_denoiser

log = logging.getLogger(__name__)

HUB_ID = re.compile(r"^[\w.-]+/[\w.-]+$")


def check_pretrained(pretrained: str) -> None:
    """A local folder must exist; anything else must look like a hub id (loaded when online)."""
    if Path(pretrained).expanduser().exists():
        return
    if HUB_ID.match(pretrained) and not pretrained.startswith("."):
        log.info("model.pretrained=%s is not a local folder; loading it from the hub", pretrained)
        return
    raise FileNotFoundError(f"model.pretrained={pretrained}: no such folder (and not a hub id like org/name)")


def _partners(preset: str, components) -> list[str]:
    """`components` with the parts that must come from the same folder as a named one added (the
    family's `partners`: SDXL's and SD3's second CLIP with the first, SD3's T5 with its tokenizer)."""
    return families.of(preset).partners_of(components)


def bundled_tokenizers(preset: str) -> dict:
    """The bundled BPE tokenizer(s) of a preset, each with its padding, and a `bundled_t5` preset's
    offline T5 tokenizer (models/engine/tokenizer.py)."""
    spec = PRESETS[preset]
    # Each CLIP tokenizer pads as its preset says: `pad_token`, `pad_token_2`.
    tokenizers = {}
    for name in families.of(preset).tokenizers:
        pad = "pad_token" + name.removeprefix("tokenizer")  # the first's may be left out: SD2's "!"
        tokenizers[name] = build_tokenizer(pad_token=spec[pad] if name != "tokenizer" else spec.get(pad, "!"))
    if bundled_t5(preset):
        tokenizers[families.of(preset).t5_tokenizer] = build_t5_tokenizer()
    if spec.get("bundled_text"):  # an LLM's tokenizer built offline (zimage-tiny's)
        tokenizers.update(families.of(preset).conditioner.offline_tokenizers())
    return tokenizers


def build_encoders(preset: str, pretrained: str | None = None) -> dict:
    """{vae, text_encoder, tokenizer} of `preset` (and text_encoder_2, tokenizer_2 for SDXL and SD3):
    loaded from `pretrained` (a diffusers folder or hub id), else with the preset's random weights. No
    UNet or transformer: what encoding a data set needs (`sd-convert latents`), without the seconds
    and 3.5 GB a random sd2 UNet costs. (SD3's optional T5 is not among them; a `bundled_t5` preset's
    random T5 and its tokenizer are, without `pretrained`.)"""
    if preset not in PRESETS:
        raise ValueError(f"unknown model preset {preset!r}; choose one of {sorted(PRESETS)}")
    names = _partners(preset, ("vae", "text_encoder", "tokenizer"))
    if pretrained is not None:
        check_pretrained(pretrained)
        return {name: load_component(name, pretrained, preset) for name in names}
    parts = build_components(preset, skip=("unet", "transformer", "noise_scheduler"))
    parts.pop("latent_scale")
    parts.pop("latent_shift", None)
    return {**parts, **bundled_tokenizers(preset)}


def build_model(
    preset: str,
    *,
    pretrained: str | None = None,
    pretrained_components: tuple[str, ...] | list[str] | None = None,
    prediction_type: str | None = None,
    offset_noise: float = 0.0,
    min_snr_gamma: float | None = None,
    zero_terminal_snr: bool = False,
    timestep_mean: float = 0.0,
    timestep_std: float = 1.0,
    timestep_shift: float | str | None = None,
    loss_weighting: str | None = None,
    timestep_density: str | None = None,
    caption_drop_prob: float = 0.0,
    gradient_checkpointing: bool = False,
    channels_last: bool = False,
    attention: str = "sdpa",
    low_precision_norms: str | None = None,
    compile_unet: bool | dict = False,
    fsdp_wrap: str = "blocks",
    activation_checkpointing: str | None = None,
    lora: dict | None = None,
    param_dtype: str | None = None,
    fp8: bool | str = False,
    init: str | None = None,
    eval_timesteps: int | None = None,
    train_draws: str = "rank",
    base_weights: str | None = None,
) -> StableDiffusion | RectifiedFlowTransformer:
    """The ComposerModel for `preset` (a name in models.registry.PRESETS): its family's model class
    (models/registry.py), a StableDiffusion, a StableDiffusionXL or a RectifiedFlowTransformer.

    pretrained: a diffusers-format folder (or hub id) to load `pretrained_components` from; the
        others keep the preset's random initialisation. Default components: the denoiser ("unet", or
        "transformer" for an mmdit preset), "vae", "text_encoder", "tokenizer". The seed recipe loads
        the VAE and text encoder and trains the denoiser from scratch:
        pretrained_components=[vae, text_encoder, tokenizer] (with SDXL's and SD3's second encoder
        and tokenizer). An SD3 folder's T5 (`text_encoder_3` or `tokenizer_3`, either loads both) is
        used only when named: it is off by default.
    prediction_type: "epsilon" or "v_prediction"; default: the preset's (sd2-768-v: v), else epsilon.
    zero_terminal_snr: rescale the betas so the last timestep is pure noise (Lin et al. 2023);
        needs v-prediction, since epsilon is not learnable at zero SNR.
    timestep_mean, timestep_std, timestep_shift, loss_weighting: the rectified-flow objective of an
        mmdit preset (models/families/mmdit/model.py): logit-normal timesteps (SD3's defaults 0, 1), shifted
        by `timestep_shift` in training and sampling alike (None: the noise scheduler's `shift`, a
        loaded scheduler's or the preset's, SD3's 3.0; a number, 1 = none; "auto":
        sqrt(pixels / 256^2), the SD3 paper's resolution-dependent shift, at each batch's and each
        sample's size), and an optional loss weighting (None, "sigma_sqrt", "cosmap": diffusers' names).
    timestep_density: "logit_normal" (SD3's) or "uniform" (the MLPerf Flux.1 reference's); None: the
        preset's `timestep_density` (the flux presets' uniform), else logit-normal.
    attention: "sdpa" (torch scaled_dot_product_attention, diffusers' default on torch 2) or
        "math" (the plain attention processor, for debugging or exotic devices; UNet presets only).
    low_precision_norms: "amp_bf16" or "amp_fp16" to run the denoiser's GroupNorm/LayerNorm in that
        precision with Composer's low-precision modules (only meaningful under that AMP precision).
    compile_unet: true to torch.compile the denoiser (UNet or transformer) in place, or a dict of
        torch.compile options, e.g. {mode: reduce-overhead} (CUDA graphs) or {backend: aot_eager} (no
        C compiler needed). Static shapes unless the dict gives `dynamic`: one graph per input shape
        (each aspect-ratio bucket's), compiled at its first batch, never a dynamic-shape one. Under
        CUDA graphs each denoiser call starts a new CUDA-graph step (models/training/torch_compile.py says
        why).
    fsdp_wrap, activation_checkpointing: the denoiser's FSDP units ("unet": the whole network,
        "blocks", "layers") and the ones recomputed in the backward pass under FSDP (None, "blocks",
        "layers"); see models/training/sharding.py (a transformer's blocks and layers are both its
        joint-attention blocks).
    lora: {rank, alpha, target_modules, dropout, init_from} trains a peft LoRA adapter instead of the
        denoiser, starting from the LoRA file `init_from` when given (diffusers' or kohya's layout of the
        same family, rank and modules: models/training/lora_layouts.py start_from)
        (models/training/lora.py; the family's default targets: models/registry.py `lora_targets`); needs
        every network from `pretrained`, and checkpoints hold the adapter only.
    param_dtype: None or "float32" (the default: fp32 weights, which autocast casts to bf16 on each
        use), or "bfloat16": the denoiser's weights and buffers are bf16 (cast after the other
        switches), so the forward and backward read them as they are; the run's AdamW keeps fp32
        master weights and moments (extensions/master_weights.py). The frozen VAE and text encoders
        stay as they are.
    fp8: true (torchao's "rowwise" recipe), "tensorwise" or "rowwise_with_gw_hp" trains the
        transformer blocks' attention and MLP matmuls in float8 (models/training/fp8.py: which layers, why);
        transformer presets only; weights, checkpoints and exports stay high precision. Emulated
        without CUDA, an error on a GPU older than sm_89. Default false.
    init: None (diffusers' own initialisation) or a rule of the preset's family for a denoiser trained
        from scratch (models/registry.py `inits`: the flux presets' "reference", the MLPerf Flux.1
        reference's, models/families/flux/reference_init.py); never over a pretrained denoiser.
    eval_timesteps: validate each sample at one of K evenly spaced timesteps (its eval seed picks
        which) and add the metric FixedTimestepLoss, MLPerf's Flux rule with K = 8
        (models/engine/eval_timesteps.py); None: at a seeded random timestep.
    train_draws: "rank" (training's noise, timesteps and caption dropout from the global RNG, which
        Composer seeds seed + rank) or "sample" (keyed by the run's seed, the batch index and each
        sample's index: the same on any number of processes; models/engine/draw_keys.py).
    base_weights: None (the base as loaded), "bf16", "fp8" or "nf4": a LoRA run's frozen denoiser and
        large text encoders (T5, an LLM; not the CLIPs or the VAE) stored in bf16, or with their linear
        weights quantized by torchao (float8 with a scale per row, or QLoRA's NF4); the adapter and its
        optimizer state stay fp32 (models/training/base_weights.py). fp8 and nf4: transformer presets.
    """
    objective, pretrained_components, lora = checked(
        preset, pretrained, pretrained_components, prediction_type, offset_noise, min_snr_gamma,
        zero_terminal_snr, timestep_mean, timestep_std, timestep_shift, loss_weighting, timestep_density,
        attention, fsdp_wrap, activation_checkpointing, lora, param_dtype, fp8, init, eval_timesteps,
        train_draws, base_weights,
    )  # fmt: skip
    parts = _parts(preset, pretrained, pretrained_components)
    if init is not None:
        families.of(preset).inits[init](parts[denoiser_name(preset)])
    options = _objective(preset, parts, pretrained_components if pretrained else (), objective)
    denoiser = parts[denoiser_name(preset)]
    if base_weights is not None:  # before the adapter: peft wraps the stored layers
        store_base(parts, denoiser_name(preset), preset, base_weights)
    init_from = lora.pop("init_from", None) if lora is not None else None  # not the record's: read once
    if lora is not None:
        add_adapter_over(denoiser, base_weights, lora)
    if init_from is not None:
        start_from(denoiser, init_from, families.of(preset))
    _speed_switches(denoiser, attention, gradient_checkpointing, channels_last, low_precision_norms)
    if PARAM_DTYPES[param_dtype] is not None:
        # In place, channels-last kept. nn.Module's: diffusers' override warns of fp32 modules to
        # keep even when its list of them is empty (the UNet's and SD3 transformer's are).
        torch.nn.Module.to(denoiser, PARAM_DTYPES[param_dtype])
    if fp8_recipe(fp8) is not None:  # after the weights' dtype, before FSDP units and compiling
        convert_to_fp8(denoiser, fp8_recipe(fp8))
    configure_sharding(denoiser, fsdp_wrap, activation_checkpointing)
    if compile_unet:
        compile_denoiser(denoiser, compile_unet if isinstance(compile_unet, dict) else {})

    model = families.of(preset).model_class(caption_drop_prob=caption_drop_prob, **options, **parts)
    if lora is not None:
        model.register_state_dict_post_hook(drop_frozen_weights)
    # For the checkpoint's model record (models/checkpoints/record.py).
    model.preset = preset
    model.tokenizer_source = pretrained if pretrained and "tokenizer" in pretrained_components else None
    model.pretrained = (
        {"source": pretrained, "components": list(pretrained_components)} if pretrained else None
    )
    model.lora = lora
    model.base_weights = base_weights  # the record's, so that an export rebuilds the same base
    if eval_timesteps is not None:
        model.set_eval_timesteps(eval_timesteps)
    model.set_train_draws(train_draws)
    return model


def check_model_options(preset: str, **options) -> None:
    """The checks `build_model` makes before it builds anything, alone: a run config's `model:`
    section is checked when it is parsed, before the data are prepared (recipes/config.py)."""
    bound = inspect.signature(build_model).bind(preset, **options)
    bound.apply_defaults()
    checked(**{name: bound.arguments[name] for name in inspect.signature(checked).parameters})


def _parts(preset: str, pretrained: str | None, pretrained_components: list[str]) -> dict:
    """The model's components: `pretrained_components` loaded from `pretrained`, the rest built with
    the preset's random weights (and the bundled tokenizers), with the latent scale (and SD3's shift)
    of the VAE in use."""
    # Components about to be loaded are not built (a random sd2 UNet takes seconds and 3.5 GB).
    loaded = [("noise_scheduler" if name == "scheduler" else name) for name in pretrained_components]
    parts = build_components(preset, skip=loaded if pretrained is not None else ())
    # Each bundled tokenizer not about to be loaded (the CLIP ones load together: _partners).
    for name, tokenizer in bundled_tokenizers(preset).items():
        if pretrained is None or name not in pretrained_components:
            parts[name] = tokenizer
    if pretrained is None:
        return parts
    check_pretrained(pretrained)
    for name in pretrained_components:
        key = "noise_scheduler" if name == "scheduler" else name
        parts[key] = load_component(name, pretrained, preset)
        log.info("loaded %s from %s", name, pretrained)
    options = families.of(preset).options
    # SDXL's unconditional branch (models/families/sdxl/model.py)
    if "force_zeros_for_empty_prompt" in options:
        parts["force_zeros_for_empty_prompt"] = _pipeline_flag(
            pretrained, "force_zeros_for_empty_prompt", True
        )
    if "vae" in pretrained_components:  # the latent scale belongs to the VAE it was measured on
        parts["latent_scale"] = parts["vae"].config.get("scaling_factor", 1.0)  # none in FLUX.2's: 1
        if "latent_shift" in options:  # and so does SD3's shift (None in VAEs that have none)
            parts["latent_shift"] = parts["vae"].config.get("shift_factor") or 0.0
    return parts


def _pipeline_flag(pretrained: str, key: str, default):
    """A pipeline setting from the folder's (or hub id's) model_index.json: SDXL's
    `force_zeros_for_empty_prompt` decides what its unconditional branch is
    (models/families/sdxl/model.py)."""
    index = Path(pretrained).expanduser() / "model_index.json"
    if not index.is_file():
        try:
            from huggingface_hub import hf_hub_download

            index = Path(hf_hub_download(pretrained, "model_index.json"))
        except Exception:  # noqa: BLE001 - offline or no such file: the family's default
            log.info("model.pretrained=%s: no model_index.json; %s=%s", pretrained, key, default)
            return default
    return json.loads(index.read_text()).get(key, default)


def _objective(preset: str, parts: dict, loaded, objective: dict) -> dict:
    """The model class's objective keywords: rectified flow's for an mmdit preset; else the DDPM
    prediction type (given, else a loaded scheduler's, else the preset's), offset noise and min-SNR,
    with the scheduler rescaled in `parts` for zero-terminal SNR."""
    if families.of(preset).objective == "flow":
        flow = {key: objective[key] for key in FLOW_OPTIONS}
        flow["timestep_density"] = flow["timestep_density"] or PRESETS[preset].get("timestep_density")
        return dict(**families.preset_options(preset), **flow)
    prediction_type = objective["prediction_type"]
    if "scheduler" in loaded and prediction_type is None:  # e.g. SD2-768's v
        prediction_type = parts["noise_scheduler"].config.get("prediction_type", "epsilon")
    prediction_type = prediction_type or PRESETS[preset].get("prediction_type", "epsilon")
    if objective["zero_terminal_snr"]:
        if prediction_type != "v_prediction":
            raise ValueError(
                "zero_terminal_snr needs prediction_type=v_prediction (epsilon is undefined at SNR 0)"
            )
        # Lin et al. 2023: rescaled betas (the last step is pure noise) and samplers that start at
        # that last step ("trailing" spacing); their guidance rescale is generate()'s option.
        parts["noise_scheduler"] = DDPMScheduler.from_config(
            parts["noise_scheduler"].config, rescale_betas_zero_snr=True, timestep_spacing="trailing"
        )
    return dict(
        prediction_type=prediction_type,
        offset_noise=objective["offset_noise"],
        min_snr_gamma=objective["min_snr_gamma"],
    )


def _speed_switches(denoiser, attention, gradient_checkpointing, channels_last, low_precision_norms):
    """The denoiser's speed and memory switches (build_model's docstring says what each does)."""
    if attention == "math":
        denoiser.set_attn_processor(AttnProcessor())
    if gradient_checkpointing:
        denoiser.enable_gradient_checkpointing()
    if channels_last:
        denoiser.to(memory_format=torch.channels_last)
    if low_precision_norms is not None:
        from composer.algorithms.low_precision_groupnorm import apply_low_precision_groupnorm
        from composer.algorithms.low_precision_layernorm import apply_low_precision_layernorm
        from composer.core import Precision

        if any(isinstance(m, torch.nn.GroupNorm) for m in denoiser.modules()):  # a transformer has none
            apply_low_precision_groupnorm(denoiser, Precision(low_precision_norms))
        apply_low_precision_layernorm(denoiser, Precision(low_precision_norms))
