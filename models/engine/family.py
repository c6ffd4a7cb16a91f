"""What a model family is: the `Family` record each family folder declares (models/families/*/family.py)
and the registry lists (models/registry.py), the objectives' options every record of a family keeps, and
how a component is built from a config. Nothing here names a family.
"""

from collections.abc import Callable
from dataclasses import dataclass, field, fields

import torch
from transformers import CLIPTokenizer, PreTrainedModel, T5TokenizerFast

from models.engine.objectives import SAMPLERS, FlowOptions

REQUIRED = object()  # an option every record of the family has (no default)
# The rectified-flow objective's options with their defaults (FlowOptions, models/engine/objectives.py);
# timestep_density None: the preset's (`timestep_density`), else logit-normal.
FLOW_OPTIONS = {option.name: option.default for option in fields(FlowOptions)}
# The DDPM objective's options with their defaults; a preset of a flow family refuses them.
DDPM_OPTIONS = dict(prediction_type=None, offset_noise=0.0, min_snr_gamma=None, zero_terminal_snr=False)
OBJECTIVE_OPTIONS = {"ddpm": DDPM_OPTIONS, "flow": FLOW_OPTIONS}

# The trained network's component name in a diffusers pipeline folder: a UNet or a transformer.
DENOISERS = ("unet", "transformer")
# Components a family's model may go without: SD3's T5 (the "t5" role: its encoder and tokenizer, by
# their folder names), built only by a `bundled_t5` preset.
OPTIONAL = T5_ENCODER, T5_TOKENIZER = ("text_encoder_3", "tokenizer_3")
# The model card an export writes beside the pipeline (models/engine/flow_folder.py); its front matter
# holds the call arguments (max_sequence_length).
README = "README.md"


class LayoutUnavailable(ValueError):
    """A LoRA layout cannot hold this adapter in a form diffusers reads back (a family's `lora_kohya`
    raises it: a module the layout has no place for, widths its reader does not split at)."""


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
    # built from `model.pipeline_parts()` (models/export.py): a flow family's is
    # models/engine/flow_folder.py's `flow_folder_writer(pipeline, components, model_card, usage)`.
    save_folder: Callable | None = None
    # `model.init` rules for a denoiser trained from scratch: name -> fn(denoiser), in place. Unset
    # (null), diffusers' own initialisation.
    inits: dict = field(default_factory=dict)
    encoder_precision: str = "fp32"  # `sd-convert latents`' default --precision (convert/latents.py)
    # `model.lora`'s default target modules: the denoiser's layers diffusers' own LoRA scripts train
    # (train_text_to_image_lora.py and its SDXL twin: the attention projections; models/training/lora.py).
    lora_targets: tuple[str, ...] = ("to_k", "to_q", "to_v", "to_out.0")
    # The kohya / ComfyUI layout of the denoiser's LoRA (the family folder's lora_layout.py), which
    # models.export --lora writes beside diffusers' file: (peft state dict, alpha, denoiser) -> the
    # layout's tensors, or LayoutUnavailable; None: the family has none that diffusers reads back
    # (models/training/lora_layouts.py).
    lora_kohya: Callable | None = None
    # Preset name -> its configs (the family folder's presets.py); models.registry.PRESETS joins them.
    presets: dict = field(default_factory=dict)
    # The toy-sized preset and its CPU recipe (yamls/<tiny_recipe>.yaml) that the conformance suite,
    # the golden bits and the demo run for the family.
    tiny: str = ""
    tiny_recipe: str = ""
    # Full-size preset -> the published checkpoint's parameter count per network and its latent scale
    # (tests/test_families.py builds each on the meta device and compares).
    published: dict = field(default_factory=dict)

    @property
    def conditioner(self):
        """The text encoders' calls (models/engine/conditioners.py): the model's, the loader's, convert's."""
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


def construct(cls, config: dict, recorded: bool = False):
    """A component of class `cls` from its config: a preset's (the keywords of its constructor), or a
    recorded one (`recorded`: the dict a diffusers or transformers config saves)."""
    if issubclass(cls, PreTrainedModel):
        config_class = cls.config_class
        return cls(config_class.from_dict(config) if recorded else config_class(**config))
    if recorded or not issubclass(cls, torch.nn.Module):  # a scheduler is built from its config alone
        return cls.from_config(config)
    return cls(**config)
