"""Stable Diffusion 1.5 / 2 (family "sd"): a UNet on one CLIP text encoder, trained with DDPM."""

from diffusers import AutoencoderKL, DDPMScheduler, StableDiffusionPipeline, UNet2DConditionModel
from transformers import CLIPTextModel, CLIPTokenizer

from models.engine.family import REQUIRED, Family
from models.families.sd.lora_layout import unet_kohya
from models.families.sd.model import StableDiffusion
from models.families.sd.presets import PUBLISHED, SD

# Component name (diffusers' folder name) -> class, in the order a preset's random weights are drawn.
COMPONENTS = dict(
    unet=UNet2DConditionModel,
    vae=AutoencoderKL,
    text_encoder=CLIPTextModel,
    tokenizer=CLIPTokenizer,
    scheduler=DDPMScheduler,
)

FAMILY = Family(
    "sd",
    StableDiffusion,
    COMPONENTS,
    StableDiffusionPipeline,
    1,
    "ddpm",
    {"prediction_type": REQUIRED},
    lora_kohya=unet_kohya,
    presets=SD,
    tiny="tiny",
    tiny_recipe="tiny-cpu",
    published=PUBLISHED,
)
