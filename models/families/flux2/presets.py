"""The flux2 family's presets (issue 50; models/families/flux2/model.py). `flux2-klein-4b`, `flux2-klein-9b`
and `flux2-dev` are black-forest-labs/FLUX.2-klein-4B, FLUX.2-klein-9B and FLUX.2-dev (family "flux2"; see
NOTES.md): diffusers' Flux2Transformer2DModel (double-stream blocks, then single-stream blocks whose QKV
and MLP projections are fused, shared AdaLN modulation, no biases, 4-axis RoPE (t, h, w, l) of theta 2000
over 128-wide heads) reading the stack of three hidden layers of a decoder LLM (`text_encoder`: Qwen3-4B's
or Qwen3-8B's layers 9, 18, 27 for klein; Mistral Small 3.2's 10, 20, 30 for dev) side by side as its
whole context, over the FLUX.2 VAE (AutoencoderKLFlux2, 32 latent channels, 8x down). The pipeline cuts
the latents into 2x2 patches (128 channels), normalises them by the VAE's own batch-norm running mean and
variance (no scalar scale or shift) and flattens them into tokens (`packing` 2). klein-4B/9B are the
step-distilled models (4 steps, no guidance); `flux2-klein-base-4b`/`-9b` are their undistilled bases
(same networks; classifier-free guidance, 50 steps), which fine-tuning starts from. dev embeds its
guidance scale (guidance-distilled, like FLUX.1-dev). `flux2-tiny` keeps the klein structure at toy size
with a tiny AutoencoderKLFlux2, a toy Qwen3 and the offline tokenizer (`bundled_text`).

Keys beyond the other families' (documentation: the model reads the layers from the encoder's depth,
model.py `quarter_layers`, which tests/test_flux2.py checks against `text_encoder_layers`; it samples
with PUBLISHED_SCHEDULER):
- `text_encoder_layers`: the hidden_states indices the pipeline stacks (`text_encoder_out_layers`);
- `published_scheduler`: the scheduler_config.json the folders ship (dynamic shifting: the sampler's, see
  NOTES.md "Sampler"); `scheduler` is the fixed-shift one the objective trains with
  (models/engine/objectives.py refuses use_dynamic_shifting);
- `component_classes` (flux2-dev): its Mistral 3 text encoder, built by models/components.py;
- `latent_norm`: "batch_norm", the latents' normalisation (vae.bn running stats; latent_scale 1, shift 0);
- `distilled` (Flux2KleinPipeline's `is_distilled`) and `sampling`: the published steps and guidance.

Parameter counts: PUBLISHED below, measured on the meta device in NOTES.md (all equal).
"""

from transformers import Mistral3ForConditionalGeneration

from models.families.sd.presets import SD

# black-forest-labs/FLUX.2-klein-4B scheduler/scheduler_config.json (diffusers 0.37.0.dev0), the same in
# every FLUX.2 folder: quoted verbatim by a Rust test fixture of the klein-4B folder
# (astronomical_model_serving; find_string id 58112689342) and by blissful-tuner's FLUX.2 architecture
# notes (id 57932856367, "identical across all FLUX.2 variants"). Sampling ignores base/max shift: the
# pipelines pass mu = compute_empirical_mu(image_seq_len, steps) (NOTES.md).
PUBLISHED_SCHEDULER = dict(
    num_train_timesteps=1000,
    shift=3.0,
    use_dynamic_shifting=True,
    base_shift=0.5,
    max_shift=1.15,
    base_image_seq_len=256,
    max_image_seq_len=4096,
    invert_sigmas=False,
    shift_terminal=None,
    stochastic_sampling=False,
    time_shift_type="exponential",
    use_beta_sigmas=False,
    use_exponential_sigmas=False,
    use_karras_sigmas=False,
)

# The training schedule: uniform sigmas on FlowMatchEulerDiscreteScheduler's 1000-step grid, unshifted.
# That is what diffusers' train_dreambooth_lora_flux2_klein.py trains with (huggingface/diffusers
# examples/dreambooth/, weighting_scheme "none" by default): it loads PUBLISHED_SCHEDULER, whose
# use_dynamic_shifting leaves the training grid unshifted (diffusers 0.42.1
# schedulers/scheduling_flow_match_euler_discrete.py:131), and draws indices uniformly.
TRAIN_SCHEDULER = dict(num_train_timesteps=1000, shift=1.0, use_dynamic_shifting=False)

# The FLUX.2 VAE (AutoencoderKLFlux2), one for all FLUX.2 models: vae/config.json of FLUX.2-klein-4B
# (its _name_or_path black-forest-labs/FLUX.2-dev; fixture id 58112689342), the same as BFL's
# AutoEncoderParams (black-forest-labs/flux2 src/flux2/autoencoder.py: ch 128, ch_mult [1, 2, 4, 4],
# num_res_blocks 2, z_channels 32; bn eps 1e-4, momentum 0.1, 2x2 patches). The published config's
# `force_upcast: true` is left out: AutoencoderKLFlux2.__init__ (diffusers 0.42.1) takes no such argument.
FLUX2_VAE = dict(
    in_channels=3,
    out_channels=3,
    down_block_types=("DownEncoderBlock2D",) * 4,
    up_block_types=("UpDecoderBlock2D",) * 4,
    block_out_channels=(128, 256, 512, 512),  # 3 downsamplings: 8x; the 2x2 patches make it 16x
    layers_per_block=2,
    act_fn="silu",
    latent_channels=32,  # x 4 = the transformer's 128 input channels
    norm_num_groups=32,
    sample_size=1024,
    use_quant_conv=True,
    use_post_quant_conv=True,
    mid_block_add_attention=True,
    batch_norm_eps=1e-4,  # BatchNorm2d(128, affine=False): its running mean and var normalise the latents
    batch_norm_momentum=0.1,
    patch_size=(2, 2),
)

# Qwen/Qwen3-4B as FLUX.2-klein-4B's text_encoder/config.json has it (Qwen3ForCausalLM, transformers
# 4.56.1; fixture id 58112689342); the same numbers as ZIMAGE's Qwen3-4B (models/families/zimage/presets.py)
# and as BFL's loader, which takes Qwen/Qwen3-4B itself (black-forest-labs/flux2 src/flux2/text_encoder.py
# load_qwen3_embedder, "Qwen/Qwen3-{variant}").
QWEN3_4B = dict(
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
    attention_bias=False,
    tie_word_embeddings=True,  # the LM head is the embedding: Qwen3ForCausalLM counts it once
)
# Qwen/Qwen3-8B (FLUX.2-klein-9B's text_encoder/: "Built on a 9B flow model with 8B Qwen3 text embedder",
# its model card as copied in knix008/MachineLearning Flux2/flux-2-klein-9b-fp8/README.md; config as
# blissful-tuner's notes quote it, id 57932856367). Its LM head is its own (tie_word_embeddings false),
# and the folder keeps it (DiffSynth-Studio pops lm_head.weight when loading the klein-9B encoder).
QWEN3_8B = dict(
    QWEN3_4B,
    hidden_size=4096,
    intermediate_size=12288,
    tie_word_embeddings=False,
)

# mistralai/Mistral-Small-3.2-24B-Instruct-2506 (FLUX.2-dev's text_encoder/, Mistral3ForConditionalGeneration:
# black-forest-labs/flux2 src/flux2/text_encoder.py Mistral3SmallEmbedder), its config as
# kohya-ss/musubi-tuner src/musubi_tuner/flux_2/flux2_utils.py quotes it (M3_CONFIG_JSON,
# "transformers_version": "4.57.1"). The published config leaves tie_word_embeddings unset, which
# Mistral 3's text config reads as false (MistralConfig's default); transformers 5.24's Mistral3Config
# defaults the top-level one to true and would tie the 671 M LM head away, so it is said here.
MISTRAL_SMALL_3 = dict(
    text_config=dict(
        model_type="mistral",
        vocab_size=131072,
        hidden_size=5120,
        intermediate_size=32768,
        num_hidden_layers=40,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        hidden_act="silu",
        max_position_embeddings=131072,
        rms_norm_eps=1e-5,
        rope_theta=1_000_000_000.0,
        sliding_window=None,
        attention_dropout=0.0,
    ),
    vision_config=dict(
        model_type="pixtral",
        hidden_size=1024,
        intermediate_size=4096,
        num_hidden_layers=24,
        num_attention_heads=16,
        head_dim=64,
        num_channels=3,
        image_size=1540,
        patch_size=14,
        hidden_act="silu",
        rope_theta=10000.0,
        attention_dropout=0.0,
    ),
    image_token_index=10,
    multimodal_projector_bias=False,
    projector_hidden_act="gelu",
    spatial_merge_size=2,
    vision_feature_layer=-1,
    tie_word_embeddings=False,
)

# Flux2Transformer2DModel's settings every FLUX.2 transformer shares (transformer/config.json of
# FLUX.2-klein-4B, fixture id 58112689342; diffusers 0.42.1's defaults; BFL's Flux2Params).
_TRANSFORMER = dict(
    patch_size=1,  # the pipeline cuts 2x2 latent patches itself (`packing`)
    in_channels=128,  # 32 latent channels x 2 x 2
    out_channels=None,
    attention_head_dim=128,
    timestep_guidance_channels=256,
    mlp_ratio=3.0,  # SwiGLU: linear_in is 2 x 3 x dim wide
    axes_dims_rope=(32, 32, 32, 32),  # RoPE dims per position axis (t, h, w, l): 128 per head
    rope_theta=2000,
    eps=1e-6,
)

FLUX2 = {}
# black-forest-labs/FLUX.2-klein-4B: transformer/config.json verbatim in fixture id 58112689342 (5 double,
# 20 single blocks, 24 heads, joint_attention_dim 7680 = 3 x 2560, guidance_embeds false), the same as BFL's
# Klein4BParams (hidden 3072, 24 heads, depth 5, depth_single_blocks 20, context_in_dim 7680, as
# kohya-ss/musubi-tuner src/musubi_tuner/flux_2/flux2_models.py and ostris/ai-toolkit vendor them).
FLUX2["flux2-klein-4b"] = dict(
    family="flux2",
    transformer=dict(
        _TRANSFORMER,
        num_layers=5,  # double-stream blocks: image and text streams, joint attention
        num_single_layers=20,  # single-stream blocks over text + image tokens
        num_attention_heads=24,  # 24 x 128 = 3072 wide
        joint_attention_dim=7680,  # 3 stacked Qwen3-4B layers x 2560
        guidance_embeds=False,
    ),
    vae=dict(FLUX2_VAE),
    text_encoder=dict(QWEN3_4B),
    text_encoder_layers=(9, 18, 27),  # Flux2KleinPipeline's text_encoder_out_layers (BFL OUTPUT_LAYERS_QWEN3)
    text_tokens=512,  # the pipeline's max_sequence_length (BFL MAX_LENGTH)
    scheduler=dict(TRAIN_SCHEDULER),
    published_scheduler=dict(PUBLISHED_SCHEDULER),
    latent_scale=1.0,  # no scalar scale or shift: the VAE's batch-norm running stats (`latent_norm`)
    latent_shift=0.0,
    latent_norm="batch_norm",
    packing=2,  # 2x2 latent patches per token (models.presets.denoiser_factor): sides multiples of 16
    # Uniform timesteps through the (unit) shift: train_dreambooth_lora_flux2_klein.py's default.
    timestep_density="uniform",
    # Step-distilled: model_index.json is_distilled true (fixture id 58112689342), so the pipeline skips
    # guidance; the model card's call: guidance_scale=1.0, num_inference_steps=4 (copied in id 55321792676;
    # musubi-tuner's FLUX2_MODEL_INFO fixes both).
    distilled=True,
    sampling=dict(steps=4, guidance_scale=1.0),
)
# black-forest-labs/FLUX.2-klein-base-4B: the same networks undistilled (Klein4BParams again in
# musubi-tuner's FLUX2_MODEL_INFO "flux.2-klein-base-4b"; guidance 4.0, 50 steps, not fixed), no
# is_distilled in its model_index.json, so Flux2KleinPipeline runs classifier-free guidance.
FLUX2["flux2-klein-base-4b"] = dict(
    FLUX2["flux2-klein-4b"], distilled=False, sampling=dict(steps=50, guidance_scale=4.0)
)
# black-forest-labs/FLUX.2-klein-9B: BFL's Klein9BParams (hidden 4096, 32 heads, depth 8,
# depth_single_blocks 24, context_in_dim 12288 = 3 x 4096, no guidance embedding; musubi-tuner
# flux2_models.py), the same as the diffusers configs third parties embed (mflux 0.20.0 model_config.py
# for FLUX.2-klein-base-9B; an AsymFLUX loader's TRANSFORMER_CONFIG, id 56154033650).
FLUX2["flux2-klein-9b"] = dict(
    FLUX2["flux2-klein-4b"],
    transformer=dict(
        _TRANSFORMER,
        num_layers=8,
        num_single_layers=24,
        num_attention_heads=32,  # 4096 wide
        joint_attention_dim=12288,  # 3 stacked Qwen3-8B layers x 4096
        guidance_embeds=False,
    ),
    text_encoder=dict(QWEN3_8B),
)
FLUX2["flux2-klein-base-9b"] = dict(
    FLUX2["flux2-klein-9b"], distilled=False, sampling=dict(steps=50, guidance_scale=4.0)
)
# black-forest-labs/FLUX.2-dev ("a 32 billion parameter rectified flow transformer", its model card:
# black-forest-labs/flux2 model_cards/FLUX.2-dev.md): BFL's Flux2Params (black-forest-labs/flux2
# src/flux2/model.py: hidden 6144, 48 heads, depth 8, depth_single_blocks 48, context_in_dim 15360 =
# 3 x 5120, a guidance embedder), diffusers 0.42.1 Flux2Transformer2DModel's defaults. For planning and
# sharding: 32 B parameters.
FLUX2["flux2-dev"] = dict(
    FLUX2["flux2-klein-4b"],
    transformer=dict(
        _TRANSFORMER,
        num_layers=8,
        num_single_layers=48,
        num_attention_heads=48,  # 6144 wide
        joint_attention_dim=15360,  # 3 stacked Mistral Small layers x 5120
        guidance_embeds=True,  # guidance-distilled: the scale is an input (x 1000, like the timestep)
    ),
    text_encoder=dict(MISTRAL_SMALL_3),
    # Not the family's Qwen3ForCausalLM: models/components.py builds this class instead.
    component_classes=dict(text_encoder=Mistral3ForConditionalGeneration),
    # Flux2Pipeline's text_encoder_out_layers (BFL OUTPUT_LAYERS_MISTRAL); its prompt is a system message
    # (SYSTEM_MESSAGE) and the caption, no generation prompt (NOTES.md).
    text_encoder_layers=(10, 20, 30),
    distilled=False,  # Flux2Pipeline has no CFG branch: `guidance_scale` goes to the guidance embedder
    # black-forest-labs/flux2 README and docs/flux2_dev_hf.md: num_inference_steps=50, guidance_scale=4.
    sampling=dict(steps=50, guidance_scale=4.0),
)
FLUX2["flux2-tiny"] = dict(
    FLUX2["flux2-klein-4b"],
    transformer=dict(
        patch_size=1,
        in_channels=16,  # the tiny VAE's 4 channels x 2 x 2: 32 px -> 8 x 8 latents -> 4 x 4 = 16 tokens
        out_channels=None,
        num_layers=2,
        num_single_layers=2,
        attention_head_dim=16,
        num_attention_heads=4,  # 64 wide
        joint_attention_dim=96,  # 3 stacked layers of the toy Qwen3 x 32
        timestep_guidance_channels=256,
        mlp_ratio=3.0,
        axes_dims_rope=(4, 4, 4, 4),  # 16 per head
        rope_theta=2000,
        eps=1e-6,
        guidance_embeds=False,
    ),
    # The `tiny` VAE's layout (the other tiny presets'), as an AutoencoderKLFlux2: 3 blocks, 4x down, 4
    # latent channels, BatchNorm2d over the 16 patch channels.
    vae=dict(SD["tiny"]["vae"], batch_norm_eps=1e-4, batch_norm_momentum=0.1, patch_size=(2, 2)),
    # A toy Qwen3 over the offline tokenizer's vocabulary (len(build_llm_tokenizer()) = 476), 4 layers so
    # that layers 1, 2, 3 stand where 9, 18, 27 stand in 36.
    text_encoder=dict(
        vocab_size=476,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=128,
        rms_norm_eps=1e-6,
        rope_theta=1_000_000,
        tie_word_embeddings=True,
    ),
    text_encoder_layers=(1, 2, 3),
    text_tokens=32,
    distilled=False,  # the tiny recipe trains and samples with guidance, as the bases
    sampling=dict(steps=4, guidance_scale=4.0),
    bundled_text=True,
)

# The published parameter counts (the meta-device counts of NOTES.md equal every one):
# - transformer: no safetensors index total_size was found for any FLUX.2 transformer. The counts are those
#   of BFL's own classes for Klein4BParams / Klein9BParams / Flux2Params as third parties count them
#   (3,875,544,576 "4B total", 9,078,581,248 "9B total", 32,223,281,152 "32.2B parameter total" in a
#   claims checker, id 70405610014; 9,078,581,248 asserted for Klein9BParams in a trainer's test, id
#   70223130571), consistent with the model cards' 4 B / 9 B / 32 B and "3.88B" (id 54846753943).
# - vae: 84,046,115, FLUX.2-klein-9B's vae/diffusion_pytorch_model.safetensors as a tt-metal bring-up
#   loader counts it (251 tensors; id 62231665913); bn.running_mean/var and num_batches_tracked are
#   buffers, not counted.
# - text_encoder: Qwen/Qwen3-4B's model.safetensors.index.json total_size 8,044,936,192 bytes of bf16
#   (= 4,022,468,096, the LM head tied; ZIMAGE's source too); Qwen/Qwen3-8B's 16,381,470,720 bytes
#   (= 8,190,735,360 with its own LM head; a test of its index, id 69062039796: 399 tensors); Mistral Small
#   3.x 24B: 24,011,361,280 (keras-hub's mistral_small_3.1_24b preset metadata "params", id 61107991196;
#   the same for 3.2 in several model tables) with the Pixtral tower, projector and LM head.
_KLEIN_4B = dict(transformer=3_875_544_576, vae=84_046_115, text_encoder=4_022_468_096, latent_scale=1.0)
_KLEIN_9B = dict(transformer=9_078_581_248, vae=84_046_115, text_encoder=8_190_735_360, latent_scale=1.0)
PUBLISHED = {
    "flux2-klein-4b": _KLEIN_4B,
    "flux2-klein-base-4b": _KLEIN_4B,
    "flux2-klein-9b": _KLEIN_9B,
    "flux2-klein-base-9b": _KLEIN_9B,
    "flux2-dev": dict(
        transformer=32_223_281_152, vae=84_046_115, text_encoder=24_011_361_280, latent_scale=1.0
    ),
}
