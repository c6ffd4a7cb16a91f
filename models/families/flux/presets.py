"""`flux-schnell` and `flux-dev` are black-forest-labs/FLUX.1-schnell and FLUX.1-dev (family "flux":
models/families/flux/model.py): a rectified-flow transformer (`transformer`, diffusers'
FluxTransformer2DModel: 19 double-stream and 38 single-stream blocks, 24 heads of 128, RoPE over 2x2 patches
of 16-channel latents, which FluxPipeline packs outside the transformer) reading T5-XXL's hidden states as its
whole context (`text_encoder_2`, `t5_tokens` long: 256 for schnell, and MLPerf's Flux.1 benchmark, 512 for
dev) and CLIP ViT-L's pooled output (`text_encoder`, CLIPTextModel) as its global vector; dev adds
the guidance embedding. Their T5 and its tokenizer load from a FLUX.1 folder (model.pretrained); the
16-channel VAE has Flux's own scale and shift. `flux-tiny` keeps that structure at toy size with the
tiny VAE and a toy T5 built offline (`bundled_t5`), as mmdit-tiny-t5.

Presets of this family, in `models.registry.PRESETS` (its functions read them).
"""

from models.engine.tokenizer import T5_VOCAB_SIZE
from models.families.mmdit.presets import SD3
from models.families.sd.presets import SD

FLUX = {}
# black-forest-labs/FLUX.1-schnell (transformer/, vae/, text_encoder{,_2}/, scheduler/ config.json).
FLUX["flux-schnell"] = dict(
    family="flux",
    transformer=dict(
        patch_size=1,  # FluxPipeline packs 2x2 latent patches itself (models/families/flux/model.py pack)
        in_channels=64,  # 16 latent channels x 2 x 2
        num_layers=19,  # double-stream blocks: image and text streams, joint attention
        num_single_layers=38,  # single-stream blocks over the concatenated sequence
        attention_head_dim=128,
        num_attention_heads=24,  # 24 x 128 = 3072 wide
        joint_attention_dim=4096,  # T5-XXL's width: the whole context
        pooled_projection_dim=768,  # CLIP ViT-L's pooled output
        guidance_embeds=False,
        axes_dims_rope=(16, 56, 56),  # RoPE dims per position axis (unused, row, column): 128 per head
    ),
    # SD3's VAE architecture with Flux's scale and shift.
    vae=dict(SD3["sd3-medium"]["vae"], scaling_factor=0.3611, shift_factor=0.1159),
    # CLIP ViT-L/14 without its projection: the pooled output (768) is the global vector.
    text_encoder=dict(SD["sd15"]["text_encoder"]),
    # T5 v1.1 XXL's encoder (google/t5-v1_1-xxl), as SD3's: its weights and sentencepiece tokenizer
    # load from a FLUX.1 folder (model.pretrained); a random one is built from this config.
    text_encoder_2=dict(SD3["sd3-medium"]["text_encoder_3"]),
    # A fixed shift of 1: FLUX.1-schnell's scheduler (use_dynamic_shifting false), and MLPerf's
    # training, which shifts nothing.
    scheduler=dict(num_train_timesteps=1000, shift=1.0, use_dynamic_shifting=False),
    latent_scale=0.3611,  # the VAE's scaling_factor
    latent_shift=0.1159,  # and its shift_factor
    t5_tokens=256,  # FLUX.1-schnell's max_sequence_length, and MLPerf's max_t5_encoding_len
    # Uniform timesteps, no shift: the MLPerf Flux.1 reference (models/engine/objectives.py
    # TIMESTEP_DENSITIES); diffusers' train_dreambooth_flux.py samples them the same way by default
    # (weighting_scheme none).
    timestep_density="uniform",
    pad_token="<|endoftext|>",  # tokenizer/ is openai/clip-vit-large-patch14's
    packing=2,  # latents packed into 2x2 patches before the transformer (models.registry's `packing`)
)
# black-forest-labs/FLUX.1-dev: schnell's networks with the guidance embedding (the guidance scale
# is an input: a guidance-distilled model), reading 512 T5 tokens.
FLUX["flux-dev"] = dict(
    FLUX["flux-schnell"],
    transformer=dict(FLUX["flux-schnell"]["transformer"], guidance_embeds=True),
    # FLUX.1-dev's scheduler shifts by resolution (use_dynamic_shifting: exp(mu), mu linear in the image
    # tokens, 3.16 at 1024 px), which the objective does not do: its fixed `shift` 3.0 instead.
    scheduler=dict(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=False),
    t5_tokens=512,
)
FLUX["flux-tiny"] = dict(
    FLUX["flux-schnell"],
    transformer=dict(
        patch_size=1,
        in_channels=16,  # the tiny VAE's 4 channels x 2 x 2: 32 px -> 8 x 8 latents -> 16 tokens
        num_layers=2,
        num_single_layers=4,
        attention_head_dim=16,
        num_attention_heads=4,  # 64 wide
        joint_attention_dim=64,  # the toy T5's width
        pooled_projection_dim=32,  # the tiny CLIP's width
        guidance_embeds=False,
        axes_dims_rope=(4, 6, 6),  # 16 per head
    ),
    # The `tiny` VAE, as mmdit-tiny's (the demo's trained one fits), its scale and no shift in its config.
    vae=dict(SD["tiny"]["vae"], scaling_factor=0.18215, shift_factor=0.0),
    text_encoder=dict(SD["tiny"]["text_encoder"], hidden_act="quick_gelu"),
    # A toy T5 with the offline tokenizer's vocabulary (models/engine/tokenizer.py build_t5_tokenizer).
    text_encoder_2=dict(
        d_model=64,
        d_ff=128,
        d_kv=16,
        num_heads=4,
        num_layers=2,
        vocab_size=T5_VOCAB_SIZE,
        feed_forward_proj="gated-gelu",
    ),
    scheduler=dict(num_train_timesteps=1000, shift=1.0, use_dynamic_shifting=False),
    latent_scale=0.18215,
    latent_shift=0.0,
    t5_tokens=8,  # the shapes' captions are 3 to 4 words
    bundled_t5=True,
)


# black-forest-labs/FLUX.1-schnell and FLUX.1-dev as diffusers counts their configs (issue 40's
# transformers, the guidance embedding the difference; CLIP ViT-L/14 without its projection; T5 v1.1
# XXL's encoder, text_encoder_2/'s safetensors index total_size 9,524,621,312 bytes of bf16; SD3's VAE
# architecture).
PUBLISHED = {
    "flux-schnell": dict(
        transformer=11_891_178_560,
        vae=83_819_683,
        text_encoder=123_060_480,
        text_encoder_2=4_762_310_656,
        latent_scale=0.3611,
    ),
    "flux-dev": dict(
        transformer=11_901_408_320,
        vae=83_819_683,
        text_encoder=123_060_480,
        text_encoder_2=4_762_310_656,
        latent_scale=0.3611,
    ),
}
