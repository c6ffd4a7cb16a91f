"""`sd3-medium` is stabilityai/stable-diffusion-3-medium-diffusers (family "mmdit":
models/families/mmdit/model.py): a rectified-flow MMDiT (`transformer`, diffusers' SD3Transformer2DModel: 24
joint-attention blocks of 24 heads of 64 over 2x2 patches of 16-channel latents) reading CLIP ViT-L/14 and
OpenCLIP bigG/14 (both with their projections: their pooled outputs side by side condition the transformer
globally) and, optionally, T5-XXL (`text_encoder_3`: its config is recorded here, its weights and tokenizer
only come from a pretrained folder). Its 16-channel VAE has a shift as well as a scale: latents are
(sample - latent_shift) * latent_scale. `t5_tokens` is the length of the T5 part of the context
(zeros when T5 is off, as StableDiffusion3Pipeline makes them). `mmdit-tiny` keeps that structure
at toy size, with the `tiny` preset's 4-channel VAE so the demo's trained tiny VAE fits.
`mmdit-tiny-t5` is mmdit-tiny reading a toy T5 too (`bundled_t5`): built with random weights like the
CLIPs, with the T5 tokenizer built offline (models/engine/tokenizer.py build_t5_tokenizer), so the T5 path
(token ids, `sd-convert latents --t5`, an export with text_encoder_3) runs with no download.

Presets of this family, in `models.registry.PRESETS` (its functions read them).
"""

from models.engine.tokenizer import T5_VOCAB_SIZE
from models.families.sd.presets import SD
from models.families.sdxl.presets import SDXL

SD3 = {}
# stabilityai/stable-diffusion-3-medium-diffusers (transformer/, vae/, text_encoder{,_2,_3}/, scheduler/
# config.json).
SD3["sd3-medium"] = dict(
    family="mmdit",
    transformer=dict(
        sample_size=128,  # 1024 px / the VAE's 8
        patch_size=2,
        in_channels=16,
        out_channels=16,
        num_layers=24,
        attention_head_dim=64,
        num_attention_heads=24,  # 24 x 64 = 1536 wide
        joint_attention_dim=4096,  # the context's width: T5-XXL's; CLIP's 768 + 1280 are zero-padded to it
        caption_projection_dim=1536,
        pooled_projection_dim=2048,  # CLIP ViT-L's 768 + bigG's 1280 pooled, projected outputs
        pos_embed_max_size=192,  # position embeddings for up to 192 x 192 patches (3072 px)
    ),
    vae=dict(
        in_channels=3,
        out_channels=3,
        latent_channels=16,
        layers_per_block=2,
        block_out_channels=(128, 256, 512, 512),
        down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4,
        sample_size=1024,
        scaling_factor=1.5305,
        shift_factor=0.0609,
        use_quant_conv=False,
        use_post_quant_conv=False,
        force_upcast=True,
    ),
    # CLIP ViT-L/14 with its projection (SDXL's first encoder has none): its pooled output counts.
    text_encoder=dict(SD["sd15"]["text_encoder"]),
    text_encoder_2=dict(SDXL["sdxl-base"]["text_encoder_2"]),  # OpenCLIP ViT-bigG/14, projected
    # T5 v1.1 XXL's encoder (google/t5-v1_1-xxl): built only from a pretrained folder, where its
    # tokenizer (sentencepiece) comes from too; recorded for the option and for reference.
    text_encoder_3=dict(
        d_model=4096,
        d_ff=10240,
        d_kv=64,
        num_heads=64,
        num_layers=24,
        vocab_size=32128,
        feed_forward_proj="gated-gelu",
        relative_attention_num_buckets=32,
        relative_attention_max_distance=128,
        layer_norm_epsilon=1e-6,
    ),
    # Euler steps on sigmas shifted by 3: SD3's sampler at 1024 px (scheduler/scheduler_config.json).
    scheduler=dict(num_train_timesteps=1000, shift=3.0),
    latent_scale=1.5305,  # the VAE's scaling_factor
    latent_shift=0.0609,  # and its shift_factor
    # SD3 trained T5 on 77 tokens (its reference code's T5 tokenizer), not diffusers' default 256: a
    # StableDiffusion3Pipeline export must be called with max_sequence_length=77 (the T5 part is
    # there even as zeros: its projected zeros are the context embedder's bias, attended to).
    t5_tokens=77,
    pad_token="<|endoftext|>",  # tokenizer/ pads like SD1 and SDXL's
    pad_token_2="!",  # tokenizer_2/ pads like SDXL's (OpenCLIP)
)
SD3["mmdit-tiny"] = dict(
    SD3["sd3-medium"],
    transformer=dict(
        sample_size=8,  # 32 px / the tiny VAE's 4
        patch_size=2,  # 4 x 4 = 16 image tokens
        in_channels=4,
        out_channels=4,
        num_layers=4,
        attention_head_dim=16,
        num_attention_heads=4,  # 64 wide
        joint_attention_dim=128,  # wider than 32 + 32, so the zero padding is exercised as in SD3
        caption_projection_dim=64,  # = the width: the two streams meet in joint attention
        pooled_projection_dim=64,  # 32 + 32
        pos_embed_max_size=16,  # up to 16 x 16 patches: 128 px, room for aspect-ratio buckets
    ),
    # The `tiny` VAE (4 channels: the demo's trained one, yamls/tiny-vae.yaml, fits), its scale and no
    # shift written into its config, where StableDiffusion3Pipeline reads them.
    vae=dict(SD["tiny"]["vae"], scaling_factor=0.18215, shift_factor=0.0),
    text_encoder=dict(SD["tiny"]["text_encoder"], hidden_act="quick_gelu"),
    text_encoder_2=dict(SD["tiny"]["text_encoder"]),
    # A toy T5 (d_model = the joint width), for tests that save one into a folder with a toy tokenizer.
    text_encoder_3=dict(
        d_model=128,
        d_ff=256,
        d_kv=16,
        num_heads=4,
        num_layers=2,
        vocab_size=32128,
        feed_forward_proj="gated-gelu",
    ),
    scheduler=dict(num_train_timesteps=1000, shift=1.0),  # 32 px: no shift towards noise
    latent_scale=0.18215,
    latent_shift=0.0,
    t5_tokens=8,  # a short zero T5 part: the tiny model spends its attention on the 77 CLIP tokens
)

# mmdit-tiny with its toy T5 built in (random weights) and the offline T5 tokenizer, whose vocabulary
# size the embedding table takes.
SD3["mmdit-tiny-t5"] = dict(
    SD3["mmdit-tiny"],
    text_encoder_3=dict(SD3["mmdit-tiny"]["text_encoder_3"], vocab_size=T5_VOCAB_SIZE),
    bundled_t5=True,
)


# stabilityai/stable-diffusion-3-medium-diffusers as diffusers counts its configs (issue 26's
# transformer; CLIP ViT-L/14 with its projection, OpenCLIP bigG/14, the 16-channel VAE).
PUBLISHED = {
    "sd3-medium": dict(
        transformer=2_028_328_000,
        vae=83_819_683,
        text_encoder=123_650_304,
        text_encoder_2=694_659_840,
        latent_scale=1.5305,
    ),
}
