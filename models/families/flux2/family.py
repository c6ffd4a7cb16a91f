"""FLUX.2 (family "flux2"): klein's rectified-flow transformer on three stacked layers of Qwen3's hidden
states, over the FLUX.2 VAE (32 channels, 2x2 patches normalised by its batch-norm statistics)."""

from diffusers import (
    AutoencoderKLFlux2,
    FlowMatchEulerDiscreteScheduler,
    Flux2KleinPipeline,
    Flux2Transformer2DModel,
)
from transformers import Qwen2Tokenizer, Qwen3ForCausalLM

from models.engine.family import FLOW_OPTIONS, REQUIRED, Family
from models.engine.flow_folder import flow_folder_writer
from models.families.flux2.folder import model_card, usage
from models.families.flux2.lora_layout import flux2_kohya
from models.families.flux2.model import Flux2
from models.families.flux2.presets import FLUX2, PUBLISHED

# Flux2KleinPipeline's folders (FLUX.2-klein-4B's model_index.json: NOTES.md); the scheduler last (its
# config is all that is drawn). FLUX.2-dev's text encoder is a Mistral 3 (its preset's
# `component_classes`), for planning: Flux2Pipeline's prompt format is not implemented.
COMPONENTS = dict(
    transformer=Flux2Transformer2DModel,
    vae=AutoencoderKLFlux2,
    text_encoder=Qwen3ForCausalLM,
    tokenizer=Qwen2Tokenizer,
    scheduler=FlowMatchEulerDiscreteScheduler,
)

FAMILY = Family(
    name="flux2",
    model_class=Flux2,
    components=COMPONENTS,
    pipeline=Flux2KleinPipeline,
    record_version=5,
    objective="flow",
    options={"latent_shift": REQUIRED, "text_tokens": REQUIRED, **dict.fromkeys(FLOW_OPTIONS, REQUIRED)},
    partners=(("text_encoder", "tokenizer"), ("tokenizer", "text_encoder")),
    patches=True,
    packing=2,
    samplers=("euler",),
    guidance_rescale=False,
    save_folder=flow_folder_writer(Flux2KleinPipeline, COMPONENTS, model_card, usage),
    encoder_precision="bf16",  # Qwen3's published weights
    # diffusers' train_dreambooth_lora_flux2_klein.py targets to_k, to_q, to_v, to_out.0 and
    # to_qkv_mlp_proj, and the single blocks' attn.to_out by full name: no suffix names those alone (a
    # double block's attn.to_out is a ModuleList, which PEFT refuses), so they are left out here.
    lora_targets=("to_k", "to_q", "to_v", "to_out.0", "to_qkv_mlp_proj"),
    lora_kohya=flux2_kohya,  # BFL's names as diffusers' FLUX.2 kohya converter reads them (lora_layout.py)
    presets=FLUX2,
    tiny="flux2-tiny",
    tiny_recipe="tiny-flux2-cpu",
    published=PUBLISHED,
)
