"""SDXL (family "sdxl"): SD's UNet on two CLIP text encoders, the second's pooled output and the
micro-conditioning sizes added to the timestep embedding."""

from diffusers import StableDiffusionXLPipeline
from transformers import CLIPTextModelWithProjection, CLIPTokenizer

from models.engine.family import REQUIRED, Family
from models.families.sd.family import COMPONENTS as SD_COMPONENTS
from models.families.sd.lora_layout import unet_kohya
from models.families.sdxl.model import StableDiffusionXL
from models.families.sdxl.presets import PUBLISHED, SDXL

SECOND_CLIP = dict(text_encoder_2=CLIPTextModelWithProjection, tokenizer_2=CLIPTokenizer)
# (named, partner): loaded together from one folder (ids of one tokenizer mean nothing to another's
# encoder; one CLIP without the other mixes models).
PARTNERS = (("text_encoder", "text_encoder_2"), ("tokenizer", "tokenizer_2"))

FAMILY = Family(
    "sdxl",
    StableDiffusionXL,
    {**SD_COMPONENTS, **SECOND_CLIP},
    StableDiffusionXLPipeline,
    2,  # a second text encoder and tokenizer: SD-only code would rebuild it without them
    "ddpm",
    {"prediction_type": REQUIRED, "force_zeros_for_empty_prompt": True},
    partners=PARTNERS,
    pooled_encoders=("text_encoder_2",),
    micro_conditioning=True,
    lora_kohya=unet_kohya,
    presets=SDXL,
    tiny="sdxl-tiny",
    tiny_recipe="tiny-sdxl-cpu",
    published=PUBLISHED,
)
