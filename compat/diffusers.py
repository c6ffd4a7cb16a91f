"""diffusers names below its public API that we use, written for diffusers 0.42.1 (first for 0.39.0).

`diffusers` exports the models, schedulers and pipelines; these live in submodules whose paths it
may move between releases:
- `models.attention_processor`: AttnProcessor (models/build.py selects plain attention; the
  default is AttnProcessor2_0, checked by tests) and Attention (tests/test_flops.py counts its FLOPs).
- `models.autoencoders.vae.DiagonalGaussianDistribution`: samples latents from the VAE's moments
  (models/families/sd/model.py), as the VAE itself does.
- `pipelines.stable_diffusion.pipeline_stable_diffusion.rescale_noise_cfg`: guidance rescale as
  diffusers' pipelines apply it, for models/families/sd/model.py's sampler.
- `models.resnet.ResnetBlock2D`: a UNet block FSDP wraps as a unit (models/training/sharding.py, with the
  public `diffusers.Transformer2DModel`).
- `utils.convert_state_dict_to_diffusers`: PEFT LoRA weights in diffusers' naming (models/training/lora.py).
- `utils.convert_state_dict_to_kohya`: PEFT LoRA weights of a UNet in kohya's naming
  (models/families/sd/lora_layout.py), and `utils.convert_unet_state_dict_to_peft`: a LoRA file's
  UNet names, as a pipeline's lora_state_dict reads them, back in peft's (models/training/lora_layouts.py),
  as diffusers' own loader does before it adds the adapter.
"""

from diffusers.models.attention_processor import Attention, AttnProcessor, AttnProcessor2_0
from diffusers.models.autoencoders.vae import DiagonalGaussianDistribution
from diffusers.models.resnet import ResnetBlock2D
from diffusers.pipelines.stable_diffusion.pipeline_stable_diffusion import rescale_noise_cfg
from diffusers.utils import (
    convert_state_dict_to_diffusers,
    convert_state_dict_to_kohya,
    convert_unet_state_dict_to_peft,
)

__all__ = [
    "Attention",
    "AttnProcessor",
    "AttnProcessor2_0",
    "DiagonalGaussianDistribution",
    "ResnetBlock2D",
    "convert_state_dict_to_diffusers",
    "convert_state_dict_to_kohya",
    "convert_unet_state_dict_to_peft",
    "rescale_noise_cfg",
]
