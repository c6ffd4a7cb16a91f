"""FLUX.1 (family "flux"): a rectified-flow transformer on T5 and CLIP's pooled output, its latents
packed 2x2, guidance distilled into dev's weights."""

from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
from transformers import CLIPTextModel, CLIPTokenizer, T5EncoderModel, T5TokenizerFast

from models.engine.family import FLOW_OPTIONS, REQUIRED, Family
from models.engine.flow_folder import flow_folder_writer
from models.families.flux.folder import model_card, usage
from models.families.flux.lora_layout import flux_kohya
from models.families.flux.model import Flux
from models.families.flux.presets import FLUX, PUBLISHED
from models.families.flux.reference_init import reference_init
from models.families.mmdit.family import LORA_TARGETS as SD3_LORA_TARGETS
from models.families.sdxl.family import PARTNERS as SDXL_PARTNERS

# CLIP ViT-L (its pooled output alone) and T5, both needed; the scheduler last (its config is all
# that is drawn).
COMPONENTS = dict(
    transformer=FluxTransformer2DModel,
    vae=AutoencoderKL,
    text_encoder=CLIPTextModel,
    tokenizer=CLIPTokenizer,
    text_encoder_2=T5EncoderModel,
    tokenizer_2=T5TokenizerFast,
    scheduler=FlowMatchEulerDiscreteScheduler,
)

FAMILY = Family(
    "flux",
    Flux,
    COMPONENTS,
    FluxPipeline,
    4,  # a T5 as text_encoder_2, CLIP's pooled output alone
    "flow",
    {"latent_shift": REQUIRED, "t5_tokens": REQUIRED, **dict.fromkeys(FLOW_OPTIONS, REQUIRED)},
    partners=SDXL_PARTNERS + (("text_encoder_2", "tokenizer_2"), ("tokenizer_2", "text_encoder_2")),
    pooled_encoders=("text_encoder",),
    patches=True,
    packing=2,
    samplers=("euler",),
    guidance_rescale=False,
    save_folder=flow_folder_writer(FluxPipeline, COMPONENTS, model_card, usage),
    inits={"reference": reference_init},  # the MLPerf Flux.1 reference's (reference_init.py)
    encoder_precision="bf16",  # as the MLPerf reference's preprocessing loads VAE, T5 and CLIP
    # train_dreambooth_lora_flux.py: the attention projections and both streams' MLPs.
    lora_targets=(
        *SD3_LORA_TARGETS,
        "ff.net.0.proj",
        "ff.net.2",
        "ff_context.net.0.proj",
        "ff_context.net.2",
    ),
    lora_kohya=flux_kohya,  # kohya sd-scripts' FLUX.1 layout (lora_layout.py)
    presets=FLUX,
    tiny="flux-tiny",
    tiny_recipe="tiny-flux-cpu",
    published=PUBLISHED,
)
