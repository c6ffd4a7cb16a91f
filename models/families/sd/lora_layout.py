"""The kohya / ComfyUI layout of a UNet's LoRA (SD 1.5 / 2 and SDXL, the family's `lora_kohya`).

`lora_unet_<the diffusers module path, dots as underscores>.lora_down.weight` (peft's lora_A),
`.lora_up.weight` (lora_B) and `.alpha` (the scale is alpha / lora_down's rows), as diffusers' own
convert_state_dict_to_kohya writes them (train_dreambooth_lora_sdxl.py --output_kohya_format). ComfyUI
maps these names onto its UNet (comfy/lora.py model_lora_keys_unet: "lora_unet_" + each diffusers
key), AUTOMATIC1111 / Forge convert them to their own, and diffusers reads them back
(StableDiffusion(XL)Pipeline.lora_state_dict: _convert_non_diffusers_lora_to_diffusers). kohya's
sd-scripts names SDXL's blocks as the original UNet does (input_blocks_4_1_...); those loaders read
both.
"""

import torch


def unet_kohya(state: dict[str, torch.Tensor], alpha: float, denoiser) -> dict[str, torch.Tensor]:
    """The adapter's tensors (peft's names, `state`) in the kohya layout, each module's alpha ours
    (convert_state_dict_to_kohya would write the rank, scale 1, whatever the run's alpha)."""
    from compat.diffusers import convert_state_dict_to_kohya

    kohya = convert_state_dict_to_kohya({f"unet.{name}": tensor for name, tensor in state.items()})
    return {k: torch.tensor(float(alpha)) if k.endswith(".alpha") else t for k, t in kohya.items()}
