"""Model presets: a plain dict from name to the component configs.

`sd2-base` is the published Stable Diffusion 2 base architecture (the diffusers configs of
stabilityai/stable-diffusion-2-base); `tiny` keeps the same structure at toy size so the recipe runs
on a CPU in seconds. Weights are random: these build architectures, not checkpoints.
"""

from diffusers import AutoencoderKL, DDPMScheduler, UNet2DConditionModel
from transformers import CLIPTextConfig, CLIPTextModel

# SD2's noise schedule (scheduler/scheduler_config.json of stable-diffusion-2-base).
SD2_SCHEDULER = dict(
    num_train_timesteps=1000,
    beta_start=0.00085,
    beta_end=0.012,
    beta_schedule="scaled_linear",
    clip_sample=False,
    set_alpha_to_one=False,
    steps_offset=1,
)

PRESETS = {
    "sd2-base": dict(
        unet=dict(
            sample_size=64,
            in_channels=4,
            out_channels=4,
            layers_per_block=2,
            block_out_channels=(320, 640, 1280, 1280),
            down_block_types=("CrossAttnDownBlock2D",) * 3 + ("DownBlock2D",),
            up_block_types=("UpBlock2D",) + ("CrossAttnUpBlock2D",) * 3,
            attention_head_dim=(5, 10, 20, 20),  # diffusers' name for the number of heads
            cross_attention_dim=1024,
            use_linear_projection=True,
        ),
        vae=dict(
            in_channels=3,
            out_channels=3,
            latent_channels=4,
            layers_per_block=2,
            block_out_channels=(128, 256, 512, 512),
            down_block_types=("DownEncoderBlock2D",) * 4,
            up_block_types=("UpDecoderBlock2D",) * 4,
            sample_size=512,
        ),
        # OpenCLIP ViT-H/14 text tower; 23 of its 24 layers because SD2 conditions on the
        # penultimate layer (the final layer norm is still applied, as in diffusers' SD2).
        text_encoder=dict(
            vocab_size=49408,
            hidden_size=1024,
            intermediate_size=4096,
            num_hidden_layers=23,
            num_attention_heads=16,
            max_position_embeddings=77,
            hidden_act="gelu",
            projection_dim=512,
        ),
        scheduler=SD2_SCHEDULER,
        latent_scale=0.18215,  # scaling_factor of SD2's VAE
    ),
    "tiny": dict(
        unet=dict(
            sample_size=8,
            in_channels=4,
            out_channels=4,
            layers_per_block=1,
            block_out_channels=(32, 64),
            down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
            up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
            attention_head_dim=(2, 4),
            cross_attention_dim=32,
            use_linear_projection=True,
            norm_num_groups=8,
        ),
        vae=dict(
            in_channels=3,
            out_channels=3,
            latent_channels=4,
            layers_per_block=1,
            block_out_channels=(16, 32, 32),  # 3 blocks: 4x downsampling, 32 px -> 8x8 latents
            down_block_types=("DownEncoderBlock2D",) * 3,
            up_block_types=("UpDecoderBlock2D",) * 3,
            norm_num_groups=8,
            sample_size=32,
        ),
        text_encoder=dict(
            vocab_size=49408,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            max_position_embeddings=77,
            hidden_act="gelu",
            projection_dim=32,
        ),
        scheduler=SD2_SCHEDULER,
        latent_scale=0.18215,
    ),
}


def build_components(preset: str) -> dict:
    """UNet, VAE, text encoder and DDPM scheduler of a preset, with random weights."""
    if preset not in PRESETS:
        raise ValueError(f"unknown model preset {preset!r}; choose one of {sorted(PRESETS)}")
    spec = PRESETS[preset]
    return dict(
        unet=UNet2DConditionModel(**spec["unet"]),
        vae=AutoencoderKL(**spec["vae"]),
        text_encoder=CLIPTextModel(CLIPTextConfig(**spec["text_encoder"])),
        noise_scheduler=DDPMScheduler.from_config(spec["scheduler"]),
        latent_scale=spec["latent_scale"],
    )
