"""Z-Image (family "zimage"): a single-stream rectified-flow transformer on a decoder LLM's (Qwen3's)
hidden states, over FLUX.1's VAE."""

from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, ZImagePipeline, ZImageTransformer2DModel
from transformers import Qwen2Tokenizer, Qwen3Model

from models.engine.family import FLOW_OPTIONS, REQUIRED, Family
from models.engine.flow_folder import flow_folder_writer
from models.families.sd.lora_layout import unet_kohya
from models.families.zimage.folder import model_card, usage
from models.families.zimage.model import ZImage
from models.families.zimage.presets import PUBLISHED, ZIMAGE

# ZImagePipeline's folders; the scheduler last (its config is all that is drawn).
COMPONENTS = dict(
    transformer=ZImageTransformer2DModel,
    vae=AutoencoderKL,
    text_encoder=Qwen3Model,
    tokenizer=Qwen2Tokenizer,
    scheduler=FlowMatchEulerDiscreteScheduler,
)

FAMILY = Family(
    name="zimage",
    model_class=ZImage,
    components=COMPONENTS,
    pipeline=ZImagePipeline,
    record_version=5,
    objective="flow",
    options={"latent_shift": REQUIRED, "text_tokens": REQUIRED, **dict.fromkeys(FLOW_OPTIONS, REQUIRED)},
    partners=(("text_encoder", "tokenizer"), ("tokenizer", "text_encoder")),
    patches=True,
    samplers=("euler",),
    guidance_rescale=False,
    save_folder=flow_folder_writer(ZImagePipeline, COMPONENTS, model_card, usage),
    encoder_precision="bf16",  # Qwen3-4B's published weights
    # lora_targets: the default, the attention projections, as train_dreambooth_lora_z_image.py's.
    # kohya's names (`lora_unet_layers_0_attention_to_q`, lora_down / lora_up / alpha) as for a UNet:
    # ZImagePipeline.lora_state_dict reads them back (_convert_non_diffusers_z_image_lora_to_diffusers).
    lora_kohya=unet_kohya,
    presets=ZIMAGE,
    tiny="zimage-tiny",
    tiny_recipe="tiny-zimage-cpu",
    published=PUBLISHED,
)
