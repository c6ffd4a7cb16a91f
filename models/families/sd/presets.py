"""The Stable Diffusion 1/2 presets (family sd: models/families/sd/model.py).

`sd2-base` is the published Stable Diffusion 2 base architecture (the diffusers configs of
stabilityai/stable-diffusion-2-base); `sd2-768-v` is stabilityai/stable-diffusion-2 (the same
networks, 768 px, v-prediction); `sd15` is runwayml/stable-diffusion-v1-5 (CLIP ViT-L/14 text
encoder, 8 attention heads, 768-wide cross-attention); `tiny` keeps SD2's structure at toy size so
the recipe runs on a CPU in seconds. Weights are random: these build architectures, not
checkpoints. Besides the component configs a preset may set the `prediction_type` its published
weights use and the tokenizer's `pad_token` (SD2 pads with "!", SD1 with "<|endoftext|>").

Presets of this family, in `models.registry.PRESETS` (its functions read them).
"""

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

SD = {
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
    # stabilityai/stable-diffusion-2: sd2-base's networks trained at 768 px (96x96 latents) to
    # predict v.
    "sd2-768-v": None,  # filled in below
    # runwayml/stable-diffusion-v1-5 (unet/, text_encoder/ config.json).
    "sd15": dict(
        unet=dict(
            sample_size=64,
            in_channels=4,
            out_channels=4,
            layers_per_block=2,
            block_out_channels=(320, 640, 1280, 1280),
            down_block_types=("CrossAttnDownBlock2D",) * 3 + ("DownBlock2D",),
            up_block_types=("UpBlock2D",) + ("CrossAttnUpBlock2D",) * 3,
            attention_head_dim=8,
            cross_attention_dim=768,
        ),
        vae=None,  # SD2's VAE, filled in below
        # OpenAI CLIP ViT-L/14's text tower, all 12 layers (SD1 conditions on the last one).
        text_encoder=dict(
            vocab_size=49408,
            hidden_size=768,
            intermediate_size=3072,
            num_hidden_layers=12,
            num_attention_heads=12,
            max_position_embeddings=77,
            hidden_act="quick_gelu",
            projection_dim=768,
        ),
        scheduler=SD2_SCHEDULER,  # SD1's schedule is the same scaled-linear 0.00085..0.012
        latent_scale=0.18215,
        pad_token="<|endoftext|>",
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

SD["sd2-768-v"] = dict(
    SD["sd2-base"],
    unet=dict(SD["sd2-base"]["unet"], sample_size=96),
    prediction_type="v_prediction",
)
SD["sd15"]["vae"] = SD["sd2-base"]["vae"]


# stabilityai/stable-diffusion-2-base as diffusers counts its configs.
PUBLISHED = {
    "sd2-base": dict(
        unet=865_910_724,
        vae=83_653_863,
        text_encoder=340_387_840,
        latent_scale=0.18215,
    ),
}
