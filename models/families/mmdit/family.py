"""SD3's MMDiT (family "mmdit"): a rectified-flow transformer on two CLIPs and an optional T5."""

from diffusers import (
    AutoencoderKL,
    FlowMatchEulerDiscreteScheduler,
    SD3Transformer2DModel,
    StableDiffusion3Pipeline,
)
from transformers import CLIPTextModelWithProjection, CLIPTokenizer, T5EncoderModel, T5TokenizerFast

from models.engine.family import FLOW_OPTIONS, REQUIRED, Family
from models.engine.flow_folder import flow_folder_writer
from models.engine.objectives import TIMESTEP_DENSITIES
from models.families.mmdit.folder import model_card, usage
from models.families.mmdit.model import RectifiedFlowTransformer
from models.families.mmdit.presets import PUBLISHED, SD3
from models.families.sdxl.family import PARTNERS as SDXL_PARTNERS
from models.families.sdxl.family import SECOND_CLIP

# SD3's CLIP ViT-L keeps its projection (its pooled output conditions the transformer), its scheduler
# is a flow-matching one, and its T5 is optional (models.engine.family.OPTIONAL).
COMPONENTS = dict(
    transformer=SD3Transformer2DModel,
    vae=AutoencoderKL,
    text_encoder=CLIPTextModelWithProjection,
    tokenizer=CLIPTokenizer,
    scheduler=FlowMatchEulerDiscreteScheduler,
    **SECOND_CLIP,
    text_encoder_3=T5EncoderModel,
    tokenizer_3=T5TokenizerFast,
)
# train_dreambooth_lora_sd3.py: both streams' attention projections.
LORA_TARGETS = (
    "attn.to_k",
    "attn.to_q",
    "attn.to_v",
    "attn.to_out.0",
    "attn.add_k_proj",
    "attn.add_q_proj",
    "attn.add_v_proj",
    "attn.to_add_out",
)

FAMILY = Family(
    "mmdit",
    RectifiedFlowTransformer,
    COMPONENTS,
    StableDiffusion3Pipeline,
    3,  # a transformer, no UNet
    "flow",
    # Records written before timestep_density trained logit-normal timesteps.
    {
        "latent_shift": REQUIRED,
        "t5_tokens": REQUIRED,
        **dict.fromkeys(FLOW_OPTIONS, REQUIRED),
        "timestep_density": TIMESTEP_DENSITIES[0],
    },
    partners=SDXL_PARTNERS + (("text_encoder_3", "tokenizer_3"), ("tokenizer_3", "text_encoder_3")),
    pooled_encoders=("text_encoder", "text_encoder_2"),
    patches=True,
    samplers=("euler",),
    guidance_rescale=False,
    save_folder=flow_folder_writer(StableDiffusion3Pipeline, COMPONENTS, model_card, usage),
    lora_targets=LORA_TARGETS,
    # No kohya / ComfyUI layout: diffusers has no converter that reads one back for SD3
    # (StableDiffusion3Pipeline.lora_state_dict converts no non-diffusers keys), so none is written;
    # ComfyUI loads diffusers' file itself (comfy/lora.py maps SD3's `transformer.` names).
    lora_kohya=None,
    presets=SD3,
    tiny="mmdit-tiny",
    tiny_recipe="tiny-mmdit-cpu",
    published=PUBLISHED,
)
