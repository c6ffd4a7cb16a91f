"""The model families: one `Family` per kind of model, in `FAMILIES`, keyed by the name a preset's
`family` gives (models.presets.family). Everything that differs between families is read from here:
the model class, the components and their classes (from which `build_components` builds a preset's
random weights), which components load together, the objective, the export pipeline, the
model record's version and options, and what `sd-convert latents` stores. Code elsewhere asks the
family (`of(preset)`, `of_model(model)`, `of_record(record)`), never compares a family's name.

The one component loader: `load_component` (a diffusers folder or hub id) and `load_folder` (an
exported pipeline folder) and `build_components` (a preset's random weights) here, and
`models.record.rebuild` (a checkpoint's record), all over the same table.
"""

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import yaml
from diffusers import (
    AutoencoderKL,
    DDPMScheduler,
    FlowMatchEulerDiscreteScheduler,
    FluxPipeline,
    FluxTransformer2DModel,
    SD3Transformer2DModel,
    StableDiffusion3Pipeline,
    StableDiffusionPipeline,
    StableDiffusionXLPipeline,
    UNet2DConditionModel,
)
from diffusers.models.modeling_utils import ModelMixin
from transformers import (
    CLIPTextModel,
    CLIPTextModelWithProjection,
    CLIPTokenizer,
    T5EncoderModel,
    T5TokenizerFast,
)

from models.flop_count import flux_step_flops, transformer_step_flops, unet_step_flops
from models.flux import Flux
from models.flux_folder import save_flux_folder
from models.flux_init import reference_init
from models.mmdit import RectifiedFlowTransformer
from models.objectives import TIMESTEP_DENSITIES
from models.presets import OPTIONAL, PRESETS, bundled_t5, construct
from models.presets import family as family_name
from models.sd3_folder import README, save_sd3_folder
from models.sdxl import StableDiffusionXL
from models.stable_diffusion import SAMPLERS, StableDiffusion

log = logging.getLogger(__name__)

REQUIRED = object()  # an option every record of the family has (no default)
# The rectified-flow objective's options (models/objectives.py); timestep_shift None: the scheduler's
# shift; timestep_density None: the preset's (`timestep_density`), else logit-normal.
FLOW_OPTIONS = dict(
    timestep_mean=0.0, timestep_std=1.0, timestep_shift=None, loss_weighting=None, timestep_density=None
)
# The DDPM objective's options with their defaults; a preset of a flow family refuses them.
DDPM_OPTIONS = dict(prediction_type=None, offset_noise=0.0, min_snr_gamma=None, zero_terminal_snr=False)
# The T5 length of an SD3 folder that does not say its own (no README.md of models.export): SD3's.
SD3_T5_TOKENS = 77


@dataclass(frozen=True)
class Family:
    """One model family. `options`: the model class's keywords (besides its components) that the
    model record keeps and `rebuild` gives back, each with its default (REQUIRED: none)."""

    name: str
    model_class: type
    # Component name (diffusers' folder name) -> class: the denoiser first, then the order a preset's
    # random weights are drawn in (a seed's bits depend on it).
    components: dict
    pipeline: type  # the diffusers pipeline models.export writes
    # One forward + backward of a meta-device denoiser per image (denoiser, height, width, context
    # length in tokens): models.flops.training_flops_per_image.
    step_flops: Callable[..., float]
    record_version: int  # code that reads fewer families refuses a record it cannot rebuild
    objective: str  # "ddpm" or "flow": which build_model options the family takes (OBJECTIVE_OPTIONS)
    options: dict = field(default_factory=dict)
    # (named, partner): a component loaded with its partner from the same folder (ids of one
    # tokenizer mean nothing to another's encoder; one CLIP without the other mixes models).
    partners: tuple[tuple[str, str], ...] = ()
    pooled_encoders: tuple[str, ...] = ()  # whose pooled, projected outputs condition the denoiser
    micro_conditioning: bool = False  # SDXL's original size and crop (convert/latents.py columns)
    patches: bool = False  # the denoiser cuts latents into patches: sides are multiples of them too
    packing: int = 1  # latents packed into packing x packing patches before the denoiser (Flux's 2)
    samplers: tuple[str, ...] = tuple(SAMPLERS)  # the first is the default
    guidance_rescale: bool = True  # generate's guidance rescale (Lin et al. 2023) applies
    # Writes an export folder (model, folder, shown_as=the folder's final name) when the pipeline is not
    # built from `model.pipeline_parts()` (models/export.py).
    save_folder: Callable | None = None
    # `model.init` rules for a denoiser trained from scratch: name -> fn(denoiser), in place. Unset
    # (null), diffusers' own initialisation.
    inits: dict = field(default_factory=dict)
    encoder_precision: str = "fp32"  # `sd-convert latents`' default --precision (convert/latents.py)
    # `model.lora`'s default target modules: the denoiser's layers diffusers' own LoRA scripts train
    # (train_text_to_image_lora.py and its SDXL twin: the attention projections; models/lora.py).
    lora_targets: tuple[str, ...] = ("to_k", "to_q", "to_v", "to_out.0")

    @property
    def conditioner(self):
        """The text encoders' calls (models/conditioners.py): the model's, the loader's, convert's."""
        return self.model_class.conditioner

    @property
    def reads_t5(self) -> bool:
        """A model of the family may have a T5 context (text_encoder_3, optional)."""
        return self.conditioner.reads_t5

    @property
    def denoiser(self) -> str:
        """The trained network's component name, "unet" or "transformer"."""
        return next(iter(self.components))

    @property
    def tokenizers(self) -> tuple[str, ...]:
        """The bundled BPE tokenizers: every CLIP tokenizer of the family."""
        return tuple(n for n, cls in self.components.items() if cls is CLIPTokenizer)

    @property
    def t5_tokenizer(self) -> str | None:
        """The T5 tokenizer's component name (SD3's optional `tokenizer_3`, Flux's `tokenizer_2`), if any."""
        return next((n for n, cls in self.components.items() if cls is T5TokenizerFast), None)

    def partners_of(self, names) -> list[str]:
        """`names` with the partner of each named component added."""
        names = list(names)
        for first, partner in self.partners:
            if first in names and partner not in names:
                names.append(partner)
        return names

    def folder_options(self, folder: Path, parts: dict) -> dict:
        """The model's options from an exported pipeline folder whose components are `parts`."""
        options = {"latent_scale": parts["vae"].config.scaling_factor}
        if "prediction_type" in self.options:
            options["prediction_type"] = parts["noise_scheduler"].config.get("prediction_type", "epsilon")
        if "force_zeros_for_empty_prompt" in self.options:  # SDXL's unconditional branch (models/sdxl.py)
            index = json.loads((folder / "model_index.json").read_text())
            options["force_zeros_for_empty_prompt"] = index.get("force_zeros_for_empty_prompt", True)
        if "latent_shift" in self.options:
            options["latent_shift"] = parts["vae"].config.get("shift_factor") or 0.0
        if "t5_tokens" in self.options:
            options["t5_tokens"] = _t5_tokens(folder)
        return options


OBJECTIVE_OPTIONS = {"ddpm": DDPM_OPTIONS, "flow": FLOW_OPTIONS}
_SD = dict(
    unet=UNet2DConditionModel,
    vae=AutoencoderKL,
    text_encoder=CLIPTextModel,
    tokenizer=CLIPTokenizer,
    scheduler=DDPMScheduler,
)
_SECOND_CLIP = dict(text_encoder_2=CLIPTextModelWithProjection, tokenizer_2=CLIPTokenizer)
# SD3's CLIP ViT-L keeps its projection (its pooled output conditions the transformer), its scheduler
# is a flow-matching one, and its T5 is optional (models.presets.OPTIONAL).
_SD3 = dict(
    transformer=SD3Transformer2DModel,
    vae=AutoencoderKL,
    text_encoder=CLIPTextModelWithProjection,
    tokenizer=CLIPTokenizer,
    scheduler=FlowMatchEulerDiscreteScheduler,
    **_SECOND_CLIP,
    text_encoder_3=T5EncoderModel,
    tokenizer_3=T5TokenizerFast,
)
_SDXL_PARTNERS = (("text_encoder", "text_encoder_2"), ("tokenizer", "tokenizer_2"))
# FLUX.1's: CLIP ViT-L (its pooled output alone) and T5, both needed; the scheduler last (its config
# is all that is drawn).
_FLUX = dict(
    transformer=FluxTransformer2DModel,
    vae=AutoencoderKL,
    text_encoder=CLIPTextModel,
    tokenizer=CLIPTokenizer,
    text_encoder_2=T5EncoderModel,
    tokenizer_2=T5TokenizerFast,
    scheduler=FlowMatchEulerDiscreteScheduler,
)

SD3_LORA_TARGETS = (
    "attn.to_k",
    "attn.to_q",
    "attn.to_v",
    "attn.to_out.0",
    "attn.add_k_proj",
    "attn.add_q_proj",
    "attn.add_v_proj",
    "attn.to_add_out",
)

FAMILIES = {
    family.name: family
    for family in (
        Family(
            "sd",
            StableDiffusion,
            _SD,
            StableDiffusionPipeline,
            unet_step_flops,
            1,
            "ddpm",
            {"prediction_type": REQUIRED},
        ),
        Family(
            "sdxl",
            StableDiffusionXL,
            {**_SD, **_SECOND_CLIP},
            StableDiffusionXLPipeline,
            unet_step_flops,
            2,  # a second text encoder and tokenizer: SD-only code would rebuild it without them
            "ddpm",
            {"prediction_type": REQUIRED, "force_zeros_for_empty_prompt": True},
            partners=_SDXL_PARTNERS,
            pooled_encoders=("text_encoder_2",),
            micro_conditioning=True,
        ),
        Family(
            "mmdit",
            RectifiedFlowTransformer,
            _SD3,
            StableDiffusion3Pipeline,
            transformer_step_flops,
            3,  # a transformer, no UNet
            "flow",
            # Records written before timestep_density trained logit-normal timesteps.
            {
                "latent_shift": REQUIRED,
                "t5_tokens": REQUIRED,
                **dict.fromkeys(FLOW_OPTIONS, REQUIRED),
                "timestep_density": TIMESTEP_DENSITIES[0],
            },
            partners=_SDXL_PARTNERS + (("text_encoder_3", "tokenizer_3"), ("tokenizer_3", "text_encoder_3")),
            pooled_encoders=("text_encoder", "text_encoder_2"),
            patches=True,
            samplers=("euler",),
            guidance_rescale=False,
            save_folder=save_sd3_folder,
            # train_dreambooth_lora_sd3.py: both streams' attention projections.
            lora_targets=SD3_LORA_TARGETS,
        ),
        Family(
            "flux",
            Flux,
            _FLUX,
            FluxPipeline,
            flux_step_flops,
            4,  # a T5 as text_encoder_2, CLIP's pooled output alone
            "flow",
            {"latent_shift": REQUIRED, "t5_tokens": REQUIRED, **dict.fromkeys(FLOW_OPTIONS, REQUIRED)},
            partners=_SDXL_PARTNERS + (("text_encoder_2", "tokenizer_2"), ("tokenizer_2", "text_encoder_2")),
            pooled_encoders=("text_encoder",),
            patches=True,
            packing=2,
            samplers=("euler",),
            guidance_rescale=False,
            save_folder=save_flux_folder,
            inits={"reference": reference_init},  # the MLPerf Flux.1 reference's (models/flux_init.py)
            encoder_precision="bf16",  # as the MLPerf reference's preprocessing loads VAE, T5 and CLIP
            # train_dreambooth_lora_flux.py: the attention projections and both streams' MLPs.
            lora_targets=(
                *SD3_LORA_TARGETS,
                "ff.net.0.proj",
                "ff.net.2",
                "ff_context.net.0.proj",
                "ff_context.net.2",
            ),
        ),
    )
}
MODEL_CLASSES = {name: family.model_class for name, family in FAMILIES.items()}


def of(preset: str) -> Family:
    """`preset`'s family."""
    return FAMILIES[family_name(preset)]


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
    """The presets of `family`, in models/presets.py's order."""
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
        parts[key] = construct(cls, spec[name])
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
    return {**parts, **family.folder_options(folder, parts)}


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


def preset_options(preset: str) -> dict:
    """The options a preset gives its model besides its components and the objective's (models.build)."""
    return {key: PRESETS[preset][key] for key in ("t5_tokens",) if key in of(preset).options}
