"""Model presets: a plain dict from name to the component configs.

`sd2-base` is the published Stable Diffusion 2 base architecture (the diffusers configs of
stabilityai/stable-diffusion-2-base); `sd2-768-v` is stabilityai/stable-diffusion-2 (the same
networks, 768 px, v-prediction); `sd15` is runwayml/stable-diffusion-v1-5 (CLIP ViT-L/14 text
encoder, 8 attention heads, 768-wide cross-attention); `tiny` keeps SD2's structure at toy size so
the recipe runs on a CPU in seconds. Weights are random: these build architectures, not
checkpoints. Besides the component configs a preset may set the `prediction_type` its published
weights use and the tokenizer's `pad_token` (SD2 pads with "!", SD1 with "<|endoftext|>").

`sdxl-base` is stabilityai/stable-diffusion-xl-base-1.0 (family "sdxl": models/sdxl.py): a UNet with
three levels and 1/2/10-deep transformers that reads two text encoders' penultimate states side by
side (`text_encoder`: CLIP ViT-L/14; `text_encoder_2`: OpenCLIP ViT-bigG/14 with its projection,
whose pooled output also conditions the UNet with the micro-conditioning sizes). `sdxl-tiny` keeps
that structure at toy size.

`sd3-medium` is stabilityai/stable-diffusion-3-medium-diffusers (family "mmdit": models/mmdit.py): a
rectified-flow MMDiT (`transformer`, diffusers' SD3Transformer2DModel: 24 joint-attention blocks of
24 heads of 64 over 2x2 patches of 16-channel latents) reading CLIP ViT-L/14 and OpenCLIP bigG/14 (both
with their projections: their pooled outputs side by side condition the transformer globally) and,
optionally, T5-XXL (`text_encoder_3`: its config is recorded here, its weights and tokenizer only come
from a pretrained folder). Its 16-channel VAE has a shift as well as a scale: latents are
(sample - latent_shift) * latent_scale. `t5_tokens` is the length of the T5 part of the context
(zeros when T5 is off, as StableDiffusion3Pipeline makes them). `mmdit-tiny` keeps that structure
at toy size, with the `tiny` preset's 4-channel VAE so the demo's trained tiny VAE fits.
`mmdit-tiny-t5` is mmdit-tiny reading a toy T5 too (`bundled_t5`): built with random weights like the
CLIPs, with the T5 tokenizer built offline (models/tokenizer.py build_t5_tokenizer), so the T5 path
(token ids, `sd-convert latents --t5`, an export with text_encoder_3) runs with no download.

`flux-schnell` and `flux-dev` are black-forest-labs/FLUX.1-schnell and FLUX.1-dev (family "flux":
models/flux.py): a rectified-flow transformer (`transformer`, diffusers' FluxTransformer2DModel: 19
double-stream and 38 single-stream blocks, 24 heads of 128, RoPE over 2x2 patches of 16-channel
latents, which FluxPipeline packs outside the transformer) reading T5-XXL's hidden states as its whole
context (`text_encoder_2`, `t5_tokens` long: 256 for schnell, and MLPerf's Flux.1 benchmark, 512 for
dev) and CLIP ViT-L's pooled output (`text_encoder`, CLIPTextModel) as its global vector; dev adds
the guidance embedding. Their T5 and its tokenizer load from a FLUX.1 folder (model.pretrained); the
16-channel VAE has Flux's own scale and shift. `flux-tiny` keeps that structure at toy size with the
tiny VAE and a toy T5 built offline (`bundled_t5`), as mmdit-tiny-t5.
"""

import torch
from transformers import PreTrainedModel

from models.tokenizer import T5_VOCAB_SIZE

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

PRESETS["sd2-768-v"] = dict(
    PRESETS["sd2-base"],
    unet=dict(PRESETS["sd2-base"]["unet"], sample_size=96),
    prediction_type="v_prediction",
)
PRESETS["sd15"]["vae"] = PRESETS["sd2-base"]["vae"]

# stabilityai/stable-diffusion-xl-base-1.0 (unet/, text_encoder/, text_encoder_2/, vae/ config.json).
PRESETS["sdxl-base"] = dict(
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
    vae=dict(PRESETS["sd2-base"]["vae"], sample_size=1024, force_upcast=True),
    text_encoder=dict(PRESETS["sd15"]["text_encoder"]),  # CLIP ViT-L/14, all 12 layers
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
PRESETS["sdxl-tiny"] = dict(
    PRESETS["sdxl-base"],
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
    vae=PRESETS["tiny"]["vae"],
    text_encoder=dict(PRESETS["tiny"]["text_encoder"], hidden_act="quick_gelu"),
    text_encoder_2=dict(PRESETS["tiny"]["text_encoder"]),
    latent_scale=0.13025,
)


# stabilityai/stable-diffusion-3-medium-diffusers (transformer/, vae/, text_encoder{,_2,_3}/, scheduler/
# config.json).
PRESETS["sd3-medium"] = dict(
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
    text_encoder=dict(PRESETS["sd15"]["text_encoder"]),
    text_encoder_2=dict(PRESETS["sdxl-base"]["text_encoder_2"]),  # OpenCLIP ViT-bigG/14, projected
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
PRESETS["mmdit-tiny"] = dict(
    PRESETS["sd3-medium"],
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
    vae=dict(PRESETS["tiny"]["vae"], scaling_factor=0.18215, shift_factor=0.0),
    text_encoder=dict(PRESETS["tiny"]["text_encoder"], hidden_act="quick_gelu"),
    text_encoder_2=dict(PRESETS["tiny"]["text_encoder"]),
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
PRESETS["mmdit-tiny-t5"] = dict(
    PRESETS["mmdit-tiny"],
    text_encoder_3=dict(PRESETS["mmdit-tiny"]["text_encoder_3"], vocab_size=T5_VOCAB_SIZE),
    bundled_t5=True,
)


# black-forest-labs/FLUX.1-schnell (transformer/, vae/, text_encoder{,_2}/, scheduler/ config.json).
PRESETS["flux-schnell"] = dict(
    family="flux",
    transformer=dict(
        patch_size=1,  # FluxPipeline packs 2x2 latent patches itself (models/flux.py pack)
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
    vae=dict(PRESETS["sd3-medium"]["vae"], scaling_factor=0.3611, shift_factor=0.1159),
    # CLIP ViT-L/14 without its projection: the pooled output (768) is the global vector.
    text_encoder=dict(PRESETS["sd15"]["text_encoder"]),
    # T5 v1.1 XXL's encoder (google/t5-v1_1-xxl), as SD3's: its weights and sentencepiece tokenizer
    # load from a FLUX.1 folder (model.pretrained); a random one is built from this config.
    text_encoder_2=dict(PRESETS["sd3-medium"]["text_encoder_3"]),
    # A fixed shift of 1: FLUX.1-schnell's scheduler (use_dynamic_shifting false), and MLPerf's
    # training, which shifts nothing.
    scheduler=dict(num_train_timesteps=1000, shift=1.0, use_dynamic_shifting=False),
    latent_scale=0.3611,  # the VAE's scaling_factor
    latent_shift=0.1159,  # and its shift_factor
    t5_tokens=256,  # FLUX.1-schnell's max_sequence_length, and MLPerf's max_t5_encoding_len
    # Uniform timesteps, no shift: the MLPerf Flux.1 reference (models/objectives.py TIMESTEP_DENSITIES);
    # diffusers' train_dreambooth_flux.py samples them the same way by default (weighting_scheme none).
    timestep_density="uniform",
    pad_token="<|endoftext|>",  # tokenizer/ is openai/clip-vit-large-patch14's
    packing=2,  # latents packed into 2x2 patches before the transformer (models.family's `packing`)
)
# black-forest-labs/FLUX.1-dev: schnell's networks with the guidance embedding (the guidance scale
# is an input: a guidance-distilled model), reading 512 T5 tokens.
PRESETS["flux-dev"] = dict(
    PRESETS["flux-schnell"],
    transformer=dict(PRESETS["flux-schnell"]["transformer"], guidance_embeds=True),
    # FLUX.1-dev's scheduler shifts by resolution (use_dynamic_shifting: exp(mu), mu linear in the image
    # tokens, 3.16 at 1024 px), which the objective does not do: its fixed `shift` 3.0 instead.
    scheduler=dict(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=False),
    t5_tokens=512,
)
PRESETS["flux-tiny"] = dict(
    PRESETS["flux-schnell"],
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
    vae=dict(PRESETS["tiny"]["vae"], scaling_factor=0.18215, shift_factor=0.0),
    text_encoder=dict(PRESETS["tiny"]["text_encoder"], hidden_act="quick_gelu"),
    # A toy T5 with the offline tokenizer's vocabulary (models/tokenizer.py build_t5_tokenizer).
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


def bundled_t5(preset: str) -> bool:
    """Whether `preset` builds its T5 (random weights) and T5 tokenizer (offline) itself, as
    mmdit-tiny-t5 and flux-tiny do; sd3-medium's and the FLUX.1 presets' T5 tokenizer only loads from
    a pretrained folder."""
    return bool(PRESETS[preset].get("bundled_t5", False))


# The trained network's component name in a diffusers pipeline folder: a UNet or a transformer.
DENOISERS = ("unet", "transformer")
# Components a family's model may go without: SD3's T5, built only by a `bundled_t5` preset.
OPTIONAL = ("text_encoder_3", "tokenizer_3")


def construct(cls, config: dict, recorded: bool = False):
    """A component of class `cls` from its config: a preset's (the keywords of its constructor), or a
    recorded one (`recorded`: the dict a diffusers or transformers config saves)."""
    if issubclass(cls, PreTrainedModel):
        config_class = cls.config_class
        return cls(config_class.from_dict(config) if recorded else config_class(**config))
    if recorded or not issubclass(cls, torch.nn.Module):  # a scheduler is built from its config alone
        return cls.from_config(config)
    return cls(**config)


def family(preset: str) -> str:
    """The name of `preset`'s family (models/family.py FAMILIES: which model class it builds)."""
    return PRESETS[preset].get("family", "sd")


def denoiser_name(preset: str) -> str:
    """The trained network's component name: "unet", or "transformer" (diffusers' names, whichever
    the preset configures; models.family's `Family.denoiser` is the same name)."""
    return next(name for name in DENOISERS if name in PRESETS[preset])


def vae_factor(preset: str) -> int:
    """Pixels per latent along each side."""
    return 2 ** (len(PRESETS[preset]["vae"]["block_out_channels"]) - 1)


def denoiser_factor(preset: str) -> int:
    """Latents per smallest feature along each side: a transformer's patch size (times the preset's
    `packing`: Flux's 2x2), or the UNet's downsamplings (2 per level below the first)."""
    config = PRESETS[preset][denoiser_name(preset)]
    patch = config.get("patch_size") or 2 ** (len(config["block_out_channels"]) - 1)
    return PRESETS[preset].get("packing", 1) * patch


def size_multiple(preset: str) -> int:
    """What image sides must be multiples of for `preset` (the VAE's factor x the denoiser's):
    8 x 8 = 64 for SD2, 8 x 4 = 32 for SDXL, 8 x 2 = 16 for SD3."""
    return vae_factor(preset) * denoiser_factor(preset)
