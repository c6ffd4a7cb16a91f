"""`z-image` and `z-image-turbo` are Tongyi-MAI/Z-Image and Z-Image-Turbo (family "zimage":
models/families/zimage/model.py): a 6 B single-stream transformer (ZImageTransformer2DModel: 2 noise-refiner
and 2 context-refiner blocks, then 30 blocks over image and caption tokens together, 30 heads of 128,
3-axis RoPE over 2x2 patches of 16-channel latents) reading Qwen3-4B's second-to-last hidden states of the
caption's chat prompt (`text_encoder`, transformers' Qwen3Model, up to `text_tokens` tokens), over
FLUX.1's VAE. Turbo is the base model distilled to 8 steps without guidance; fine-tuning starts from the
base. `zimage-tiny` keeps the structure at toy size with the tiny VAE, a toy Qwen3 and the offline
tokenizer (`bundled_text`: models/engine/llm_conditioner.py build_llm_tokenizer).

Presets of this family, in `models.registry.PRESETS` (its functions read them).
"""

from models.families.flux.presets import FLUX
from models.families.sd.presets import SD

ZIMAGE = {}
# Tongyi-MAI/Z-Image-Turbo transformer/, text_encoder/, vae/ config.json (the base model's networks are
# the same; their configs as quoted verbatim by third-party loaders, e.g. a Rust port's tests).
ZIMAGE["z-image"] = dict(
    family="zimage",
    transformer=dict(
        all_patch_size=(2,),  # 2x2 latent patches, cut by the transformer itself
        all_f_patch_size=(1,),  # one frame
        in_channels=16,
        dim=3840,  # 30 heads x 128
        n_layers=30,  # blocks over image and caption tokens together
        n_refiner_layers=2,  # per-stream blocks before them (image: noise refiner, caption: context refiner)
        n_heads=30,
        n_kv_heads=30,
        norm_eps=1e-5,
        qk_norm=True,
        cap_feat_dim=2560,  # Qwen3-4B's width
        rope_theta=256.0,
        t_scale=1000.0,
        axes_dims=(32, 48, 48),  # RoPE dims per axis (sequence, row, column): 128 per head
        axes_lens=(1536, 512, 512),
    ),
    # FLUX.1's VAE: its config, scale and shift.
    vae=dict(FLUX["flux-schnell"]["vae"]),
    # Qwen/Qwen3-4B (the base model's decoder, without its tied LM head).
    text_encoder=dict(
        vocab_size=151936,
        hidden_size=2560,
        intermediate_size=9728,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=40960,
        rms_norm_eps=1e-6,
        rope_theta=1_000_000,
        tie_word_embeddings=True,
    ),
    # Z-Image's scheduler_config.json: a fixed shift of 6 (third-party loaders tell the base model from
    # Turbo, shift 3, by it).
    scheduler=dict(num_train_timesteps=1000, shift=6.0, use_dynamic_shifting=False),
    latent_scale=0.3611,  # the VAE's scaling_factor
    latent_shift=0.1159,  # and its shift_factor
    text_tokens=512,  # ZImagePipeline's max_sequence_length
    # Uniform timesteps through the scheduler's shift: diffusers' train_dreambooth_lora_z_image.py default
    # (weighting_scheme none).
    timestep_density="uniform",
)
ZIMAGE["z-image-turbo"] = dict(
    ZIMAGE["z-image"], scheduler=dict(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=False)
)
ZIMAGE["zimage-tiny"] = dict(
    ZIMAGE["z-image"],
    transformer=dict(
        all_patch_size=(2,),
        all_f_patch_size=(1,),
        in_channels=4,  # the tiny VAE's: 32 px -> 8 x 8 latents -> 16 patches
        dim=64,  # 4 heads x 16
        n_layers=2,
        n_refiner_layers=1,
        n_heads=4,
        n_kv_heads=4,
        norm_eps=1e-5,
        qk_norm=True,
        cap_feat_dim=32,  # the toy Qwen3's width
        rope_theta=256.0,
        t_scale=1000.0,
        axes_dims=(4, 6, 6),  # 16 per head
        axes_lens=(128, 32, 32),
    ),
    # The `tiny` VAE, as the other tiny flow presets' (the demo's trained one fits), no shift.
    vae=dict(SD["tiny"]["vae"], scaling_factor=0.18215, shift_factor=0.0),
    # A toy Qwen3 over the offline tokenizer's vocabulary (len(build_llm_tokenizer()) = 476).
    text_encoder=dict(
        vocab_size=476,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=128,
        rms_norm_eps=1e-6,
        rope_theta=1_000_000,
        tie_word_embeddings=True,
    ),
    scheduler=dict(num_train_timesteps=1000, shift=1.0, use_dynamic_shifting=False),
    latent_scale=0.18215,
    latent_shift=0.0,
    text_tokens=32,  # the chat template's 10 tokens and the shapes' 3 to 4 words
    bundled_text=True,
)

# The published checkpoints' parameter counts: Tongyi-MAI/Z-Image-Turbo's transformer 6,154,908,736
# (its bf16 total as pipelines report it), Qwen/Qwen3-4B's model.safetensors.index.json total_size
# 8,044,936,192 bytes of bf16 (= 4,022,468,096 with the LM head tied), FLUX.1's VAE 83,819,683.
PUBLISHED = {
    preset: dict(transformer=6_154_908_736, vae=83_819_683, text_encoder=4_022_468_096, latent_scale=0.3611)
    for preset in ("z-image", "z-image-turbo")
}
