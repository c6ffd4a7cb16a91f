"""`sdxl-base` is stabilityai/stable-diffusion-xl-base-1.0 (family "sdxl": models/families/sdxl/model.py): a
UNet with three levels and 1/2/10-deep transformers that reads two text encoders' penultimate states side by
side (`text_encoder`: CLIP ViT-L/14; `text_encoder_2`: OpenCLIP ViT-bigG/14 with its projection,
whose pooled output also conditions the UNet with the micro-conditioning sizes). `sdxl-tiny` keeps
that structure at toy size.

Presets of this family, in `models.registry.PRESETS` (its functions read them).
"""

from models.families.sd.presets import SD, SD2_SCHEDULER

SDXL = {}
# stabilityai/stable-diffusion-xl-base-1.0 (unet/, text_encoder/, text_encoder_2/, vae/ config.json).
SDXL["sdxl-base"] = dict(
    family="sdxl",
    unet=dict(
        sample_size=128,
        in_channels=4,
        out_channels=4,
        layers_per_block=2,
        block_out_channels=(320, 640, 1280),
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
        attention_head_dim=(5, 10, 20),  # heads, as in SD2
        transformer_layers_per_block=(1, 2, 10),
        cross_attention_dim=2048,  # 768 (text_encoder) + 1280 (text_encoder_2), concatenated
        use_linear_projection=True,
        addition_embed_type="text_time",
        addition_time_embed_dim=256,  # each of the 6 micro-conditioning numbers -> 256 sinusoids
        projection_class_embeddings_input_dim=2816,  # 6 x 256 + the 1280-wide pooled text embedding
    ),
    # SD2's VAE architecture; SDXL's weights have their own scale (and overflow in fp16: upcast).
    vae=dict(SD["sd2-base"]["vae"], sample_size=1024, force_upcast=True),
    text_encoder=dict(SD["sd15"]["text_encoder"]),  # CLIP ViT-L/14, all 12 layers
    # OpenCLIP ViT-bigG/14's text tower, all 32 layers: the UNet reads the penultimate one, and the
    # pooled vector is the last layer's (after the final norm and projection).
    text_encoder_2=dict(
        vocab_size=49408,
        hidden_size=1280,
        intermediate_size=5120,
        num_hidden_layers=32,
        num_attention_heads=20,
        max_position_embeddings=77,
        hidden_act="gelu",
        projection_dim=1280,
    ),
    scheduler=SD2_SCHEDULER,  # SDXL trains on the same scaled-linear 0.00085..0.012 schedule
    latent_scale=0.13025,  # scaling_factor of SDXL's VAE
    pad_token="<|endoftext|>",  # tokenizer/ pads like SD1
    pad_token_2="!",  # tokenizer_2/ pads like SD2 (OpenCLIP)
)
SDXL["sdxl-tiny"] = dict(
    SDXL["sdxl-base"],
    unet=dict(
        sample_size=8,
        in_channels=4,
        out_channels=4,
        layers_per_block=1,
        block_out_channels=(32, 64),
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
        attention_head_dim=(2, 4),
        transformer_layers_per_block=(1, 2),
        cross_attention_dim=64,  # 32 + 32
        use_linear_projection=True,
        norm_num_groups=8,
        addition_embed_type="text_time",
        addition_time_embed_dim=8,
        projection_class_embeddings_input_dim=6 * 8 + 32,
    ),
    vae=SD["tiny"]["vae"],
    text_encoder=dict(SD["tiny"]["text_encoder"], hidden_act="quick_gelu"),
    text_encoder_2=dict(SD["tiny"]["text_encoder"]),
    latent_scale=0.13025,
)


# stabilityai/stable-diffusion-xl-base-1.0 as diffusers counts its configs (issue 25's numbers).
PUBLISHED = {
    "sdxl-base": dict(
        unet=2_567_463_684,
        vae=83_653_863,
        text_encoder=123_060_480,
        text_encoder_2=694_659_840,
        latent_scale=0.13025,
    ),
}
