"""What `build_model` checks before it builds anything (models/build.py calls `checked`;
`check_model_options` runs it alone when a run config is parsed): each option's value, options of
another objective or family than the preset's, the components and switches its family has, and what
needs which pretrained parts. Errors name the option."""

import torch

import models.registry as families
from models.engine.draw_keys import check_train_draws
from models.engine.eval_timesteps import check_eval_timesteps
from models.engine.family import OBJECTIVE_OPTIONS, OPTIONAL
from models.engine.objectives import LOSS_WEIGHTINGS, TIMESTEP_DENSITIES
from models.presets import bundled_t5, denoiser_name
from models.registry import PRESETS
from models.training.base_weights import check_base_weights
from models.training.fp8 import fp8_recipe
from models.training.lora import check_lora_options
from models.training.sharding import GRANULARITIES

# model.param_dtype -> the dtype the denoiser's weights are cast to (None: left fp32).
PARAM_DTYPES = {None: None, "float32": None, "bfloat16": torch.bfloat16}


def _check_family_options(preset: str, given: dict) -> None:
    """An option of another objective than the preset's family trains (a DDPM option on an mmdit
    preset, a rectified-flow one on a UNet preset) is an error naming it, not silently ignored."""
    family = families.of(preset)
    for objective, options in OBJECTIVE_OPTIONS.items():
        for key, default in options.items():
            if objective != family.objective and given[key] != default:
                raise ValueError(
                    f"model.{key} is a {OBJECTIVE_NAMES[objective][0]} option; preset {preset!r} (family "
                    f"{family.name}) trains {OBJECTIVE_NAMES[family.objective][1]}"
                )


# Each objective's name in the errors: as an adjective, and as what a family trains.
OBJECTIVE_NAMES = {"ddpm": ("DDPM", "the DDPM objective"), "flow": ("rectified-flow", "rectified flow")}


def checked(
    preset, pretrained, pretrained_components, prediction_type, offset_noise, min_snr_gamma,
    zero_terminal_snr, timestep_mean, timestep_std, timestep_shift, loss_weighting, timestep_density,
    attention, fsdp_wrap, activation_checkpointing, lora, param_dtype, fp8, init, eval_timesteps,
    train_draws, base_weights=None,
):  # fmt: skip
    """build_model's options checked: (objective keywords, components to load, LoRA options)."""
    if preset not in PRESETS:
        raise ValueError(f"unknown model preset {preset!r}; choose one of {sorted(PRESETS)}")
    if eval_timesteps is not None:
        check_eval_timesteps(eval_timesteps)
    check_train_draws(train_draws)
    objective = dict(
        prediction_type=prediction_type,
        offset_noise=offset_noise,
        min_snr_gamma=min_snr_gamma,
        zero_terminal_snr=zero_terminal_snr,
        timestep_mean=timestep_mean,
        timestep_std=timestep_std,
        timestep_shift=timestep_shift,
        loss_weighting=loss_weighting,
        timestep_density=timestep_density,
    )
    _check_family_options(preset, objective)
    if loss_weighting not in LOSS_WEIGHTINGS:
        raise ValueError(f"model.loss_weighting={loss_weighting!r}; choose one of {list(LOSS_WEIGHTINGS)}")
    if timestep_density not in (None, *TIMESTEP_DENSITIES):
        raise ValueError(
            f"model.timestep_density={timestep_density!r}; choose one of {list(TIMESTEP_DENSITIES)}"
        )
    if pretrained_components is None:
        pretrained_components = (denoiser_name(preset), "vae", "text_encoder", "tokenizer")
    _check_switches(preset, pretrained_components, attention, fsdp_wrap, activation_checkpointing)
    if param_dtype not in PARAM_DTYPES:
        raise ValueError(f"model.param_dtype={param_dtype!r}; choose one of {list(PARAM_DTYPES)}")
    if fp8_recipe(fp8) is not None and families.of(preset).denoiser != "transformer":
        raise ValueError(
            f"model.fp8 trains transformer presets; {preset!r} is a UNet, whose convolutions "
            "torchao's Float8Linear does not cover"
        )
    pretrained_components = families.of(preset).partners_of(pretrained_components)
    _check_init(preset, init, pretrained, pretrained_components)
    _check_t5_tokenizer(preset, pretrained, pretrained_components)
    if "text_encoder_3" in pretrained_components and pretrained is None:
        raise ValueError(
            "pretrained_components names text_encoder_3 (T5), which loads only from model.pretrained: "
            "a T5 tokenizer cannot be built offline"
        )
    if lora is not None:
        lora = check_lora_options(lora, pretrained, pretrained_components, preset)
    check_base_weights(base_weights, preset, lora, param_dtype, fp8)  # models/training/base_weights.py

    return objective, pretrained_components, lora


def _check_init(preset, init, pretrained, pretrained_components) -> None:
    """model.init: a rule of the preset's family, on a denoiser trained from scratch."""
    if init is None:
        return
    rules = families.of(preset).inits
    if init not in rules:
        raise ValueError(
            f"model.init={init!r}: preset {preset!r} has {sorted(rules) or 'no such rule'} "
            "(null: diffusers' initialisation)"
        )
    if pretrained is not None and denoiser_name(preset) in pretrained_components:
        raise ValueError(
            f"model.init={init} initialises a denoiser trained from scratch, but this one loads from "
            f"model.pretrained={pretrained}: leave model.init unset, or leave {denoiser_name(preset)} out "
            "of pretrained_components"
        )


def _check_t5_tokenizer(preset, pretrained, pretrained_components) -> None:
    """A family that always reads T5 (Flux) needs its tokenizer from a folder, unless the preset builds
    a toy one offline (`bundled_t5`): an error before anything is built, not a missing argument."""
    t5 = families.of(preset).t5_tokenizer
    if not t5 or t5 in OPTIONAL or bundled_t5(preset):
        return
    if pretrained is None or t5 not in pretrained_components:
        raise ValueError(
            f"preset {preset!r} reads T5, whose tokenizer ({t5}) is not built offline: give "
            f"model.pretrained, a folder with {t5}/ (a FLUX.1 one), and name {t5} in pretrained_components"
        )


def _check_switches(preset, pretrained_components, attention, fsdp_wrap, activation_checkpointing) -> None:
    """Errors naming the option for components and switches this preset's family does not have."""
    family = families.of(preset)
    unknown = set(pretrained_components) - set(family.components)
    if unknown:
        raise ValueError(
            f"pretrained_components: unknown {sorted(unknown)} for preset {preset!r}; choose from "
            f"{sorted(family.components)}"
        )
    if attention not in ("sdpa", "math"):
        raise ValueError(f"attention={attention!r}; choose 'sdpa' or 'math'")
    if family.denoiser != "unet" and attention == "math":
        raise ValueError(
            "attention='math' is a UNet option: the transformer's joint attention runs sdpa only"
        )
    for key, value in (("fsdp_wrap", fsdp_wrap), ("activation_checkpointing", activation_checkpointing)):
        if value is not None and value not in GRANULARITIES:
            raise ValueError(f"{key}={value!r}; choose one of {GRANULARITIES}")
