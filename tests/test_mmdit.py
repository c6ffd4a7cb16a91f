"""The rectified-flow MMDiT family (models/families/mmdit/model.py, presets sd3-medium and mmdit-tiny): the
published sizes, the objective against a hand computation, the logit-normal timesteps, the conditioning and
the sampler against diffusers' own StableDiffusion3Pipeline, pretrained folders (T5 too), FLOPs, FSDP
units, and the tiny recipe training. (Caption dropout, precomputed embeddings, the training step,
validation's determinism and parameter counts: the suite of every family, tests/test_families.py.)"""

import math

import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler, StableDiffusion3Pipeline
from diffusers.training_utils import compute_loss_weighting_for_sd3

from compat.diffusers import DiagonalGaussianDistribution
from models import RectifiedFlowTransformer, build_model
from models.components import build_components
from models.engine.objectives import resolution_shift, shift_timesteps
from models.engine.tokenizer import build_t5_tokenizer, tokenize
from models.flops import training_flops_per_image
from models.presets import size_multiple
from models.registry import PRESETS
from models.training import sharding
from recipes import build_trainer, load_config
from tests.conftest import REPO, tiny_run

# T5 v1.1 XXL's encoder as diffusers 0.39 counts its published config (not in the preset's parts).
T5_XXL_ENCODER = 4_762_310_656
PROMPTS = ["a red circle", "a small green square on the left"]


def count(module) -> int:
    return sum(p.numel() for p in module.parameters())


@pytest.mark.heavy
def test_sd3_medium_has_the_published_t5_vae_and_schedule():
    """(The transformer's, CLIPs' and VAE's parameter counts: tests/test_families.py.)"""
    from transformers import T5Config, T5EncoderModel

    with torch.device("meta"):  # 2.9 B parameters (7.7 B with T5): shapes only
        parts = build_components("sd3-medium")
        t5 = T5EncoderModel(T5Config(**PRESETS["sd3-medium"]["text_encoder_3"]))
    assert count(t5) == T5_XXL_ENCODER
    assert "text_encoder_3" not in parts  # T5 only ever loads from a folder
    # The VAE's scale and shift, in the config the pipeline decodes with and in the model's buffers.
    assert (parts["latent_scale"], parts["latent_shift"]) == (1.5305, 0.0609)
    assert (parts["vae"].config.scaling_factor, parts["vae"].config.shift_factor) == (1.5305, 0.0609)
    assert parts["vae"].config.latent_channels == 16
    assert isinstance(parts["noise_scheduler"], FlowMatchEulerDiscreteScheduler)
    assert parts["noise_scheduler"].config.shift == 3.0
    assert size_multiple("sd3-medium") == 16 and size_multiple("mmdit-tiny") == 8


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return build_model("mmdit-tiny").eval()


def _batch(model, captions=PROMPTS, size=32):
    generator = torch.Generator().manual_seed(3)
    return {
        "image": torch.rand(len(captions), 3, size, size, generator=generator) * 2 - 1,
        "input_ids": tokenize(model.tokenizer, captions),
        "input_ids_2": tokenize(model.tokenizer_2, captions),
    }


def _pipeline(model) -> StableDiffusion3Pipeline:
    """diffusers' SD3 pipeline around the model's own components (no T5 unless the model has one)."""
    return StableDiffusion3Pipeline(
        transformer=model.transformer,
        scheduler=FlowMatchEulerDiscreteScheduler.from_config(model.noise_scheduler.config),
        vae=model.vae,
        text_encoder=model.text_encoder,
        tokenizer=model.tokenizer,
        text_encoder_2=model.text_encoder_2,
        tokenizer_2=model.tokenizer_2,
        text_encoder_3=model.text_encoder_3,
        tokenizer_3=model.tokenizer_3,
    )


def _transformer_call(model, run) -> dict:
    """The keyword arguments and output of the transformer's (single) call during `run()`."""
    seen = {}

    def before(module, args, kwargs):
        seen.update(kwargs)

    def after(module, args, kwargs, output):
        seen["output"] = output.sample

    handles = [
        model.transformer.register_forward_pre_hook(before, with_kwargs=True),
        model.transformer.register_forward_hook(after, with_kwargs=True),
    ]
    try:
        seen["result"] = run()
    finally:
        for handle in handles:
            handle.remove()
    return seen


def test_loss_and_target_are_the_rectified_flow_objective():
    """With the validation draws (a generator per sample, seeded): x0 = (posterior sample - shift) *
    scale, t = shifted sigmoid(mean + std * n), x_t = (1 - t) x0 + t noise, timestep 1000 t, target
    noise - x0, loss the per-sample MSE weighted as diffusers' SD3 script weighs it, all by hand. (That
    these draws are the same every time: tests/test_families.py.)"""
    torch.manual_seed(0)
    model = build_model(
        "mmdit-tiny", timestep_mean=0.3, timestep_std=0.8, timestep_shift=2.5, loss_weighting="cosmap"
    ).eval()
    model.latent_shift.fill_(0.05)  # a VAE with a shift, as SD3's
    batch, seeds = _batch(model), [11, 12]
    seen = _transformer_call(model, lambda: model._diffuse(batch, seeds=seeds))
    prediction, target, t = seen["result"]

    posterior = DiagonalGaussianDistribution(model.vae.encode(batch["image"]).latent_dist.parameters)
    expected_x0, expected_noise, expected_t = [], [], []
    for i, seed in enumerate(seeds):
        generator = torch.Generator().manual_seed(seed)
        latent = torch.randn(posterior.mean.shape[1:], generator=generator)
        noise = torch.randn(posterior.mean.shape[1:], generator=generator)
        u = 1 / (1 + math.exp(-(0.3 + 0.8 * float(torch.randn((), generator=generator)))))
        expected_x0.append((posterior.mean[i] + posterior.std[i] * latent - 0.05) * 0.18215)
        expected_noise.append(noise)
        expected_t.append(2.5 * u / (1 + 1.5 * u))
    x0, noise, hand_t = torch.stack(expected_x0), torch.stack(expected_noise), torch.tensor(expected_t)
    torch.testing.assert_close(t, hand_t)
    sigma = hand_t.view(-1, 1, 1, 1)
    torch.testing.assert_close(seen["hidden_states"], (1 - sigma) * x0 + sigma * noise)
    torch.testing.assert_close(seen["timestep"], 1000 * hand_t)
    torch.testing.assert_close(target, noise - x0)
    assert torch.equal(prediction, seen["output"])
    per_sample = ((seen["output"] - (noise - x0)) ** 2).mean(dim=(1, 2, 3))
    weights = compute_loss_weighting_for_sd3("cosmap", sigmas=hand_t)
    loss = model.loss((prediction, target, t), batch)
    torch.testing.assert_close(loss, (per_sample * weights).mean())


@pytest.mark.parametrize(("shift", "mean", "std"), [(1.0, 0.0, 1.0), (3.0, 0.0, 1.0), (1.0, -0.5, 0.7)])
@pytest.mark.heavy
def test_logit_normal_timesteps(shift, mean, std):
    """logit(t) is normal with the configured mean and std; a shift s multiplies t's odds by s, so it
    adds log(s) to logit(t) (eq. 23 of the SD3 paper)."""
    model = build_model("mmdit-tiny", timestep_mean=mean, timestep_std=std, timestep_shift=shift)
    t = model.sample_timesteps(torch.randn(200_000, generator=torch.Generator().manual_seed(0)), (32, 32))
    assert 0 < t.min() and t.max() < 1
    logit = torch.log(t / (1 - t)).double()
    assert logit.mean().item() == pytest.approx(mean + math.log(shift), abs=0.01)
    assert logit.std().item() == pytest.approx(std, rel=0.01)
    # Training draws them from the global RNG: different each step, in (0, 1), 1000 t to the transformer.
    model.train()
    batch = _batch(model)
    first = _transformer_call(model, lambda: model(batch))
    second = _transformer_call(model, lambda: model(batch))
    assert not torch.equal(first["timestep"], second["timestep"])
    torch.testing.assert_close(first["timestep"], 1000 * first["result"][2])


@pytest.mark.heavy
def test_timestep_shift_is_the_flow_schedulers_and_auto_follows_the_resolution():
    scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0)  # its sigmas: the unshifted ones, shifted
    plain = FlowMatchEulerDiscreteScheduler(shift=1.0)
    torch.testing.assert_close(scheduler.sigmas, shift_timesteps(plain.sigmas, 3.0))
    assert [resolution_shift(r, r) for r in (256, 512, 1024)] == [1.0, 2.0, 4.0]
    auto = build_model("mmdit-tiny", timestep_shift="auto")
    assert auto.shift_for((32, 32)) == 0.125 and auto.shift_for((192, 320)) == pytest.approx(
        math.sqrt(0.9375)
    )
    with pytest.raises(ValueError, match="timestep_shift"):
        build_model("mmdit-tiny", timestep_shift=0)


def test_conditioning_is_what_the_sd3_pipeline_encodes(model):
    """The context (both CLIPs' penultimate states, zero-padded to the joint width, then t5_tokens of
    zeros) and the pooled vector equal StableDiffusion3Pipeline.encode_prompt's for the same encoders
    and max_sequence_length=t5_tokens; the unconditional half is the empty caption's, the pipeline's
    default negative prompt."""
    pipe = _pipeline(model)
    embeds, negative, pooled, negative_pooled = pipe.encode_prompt(
        PROMPTS, None, None, device="cpu", max_sequence_length=model.t5_tokens
    )
    context, ours_pooled = model.encode_captions(PROMPTS, "cpu")
    assert context.shape == (2, 77 + 8, 128) and ours_pooled.shape == (2, 64)
    assert context[:, :, 64:].eq(0).all() and context[:, 77:].eq(0).all()  # the padding, the T5 part
    torch.testing.assert_close(context, embeds, rtol=0, atol=0)
    torch.testing.assert_close(ours_pooled, pooled, rtol=0, atol=0)
    condition = model.prompt_condition(PROMPTS, None, (32, 32), "cpu")
    torch.testing.assert_close(
        condition["encoder_hidden_states"], torch.cat([negative, embeds]), rtol=0, atol=0
    )
    torch.testing.assert_close(
        condition["pooled_projections"], torch.cat([negative_pooled, pooled]), rtol=0, atol=0
    )
    empty, empty_pooled = model.empty_condition("cpu")  # encoded alone: a 1-row GEMM's last bits
    torch.testing.assert_close(negative, empty.expand(2, -1, -1))
    torch.testing.assert_close(negative_pooled, empty_pooled.expand(2, -1))


def test_generate_samples_what_the_sd3_pipeline_samples(model):
    """The same seed through our Euler steps and through StableDiffusion3Pipeline (our components,
    max_sequence_length=t5_tokens, no negative prompt) gives the same image; per-prompt seeds are the
    pipeline's list of generators; a guidance of 1 runs the conditional branch alone, as it does."""
    pipe = _pipeline(model)
    settings = dict(num_inference_steps=4, guidance_scale=4.0, height=32, width=32)

    def theirs(**kw):
        kw = {**settings, **kw}
        return pipe(PROMPTS, max_sequence_length=model.t5_tokens, output_type="pt", **kw).images

    ours = model.generate(PROMPTS, seed=7, **settings)
    assert ours.shape == (2, 3, 32, 32) and 0 <= ours.min() and ours.max() <= 1
    torch.testing.assert_close(ours, theirs(generator=torch.Generator().manual_seed(7)), rtol=0, atol=1e-6)
    per_prompt = model.generate(PROMPTS, seeds=[5, 9], **settings)
    generators = [torch.Generator().manual_seed(s) for s in (5, 9)]
    torch.testing.assert_close(per_prompt, theirs(generator=generators), rtol=0, atol=1e-6)
    unguided = model.generate(PROMPTS, seed=7, **{**settings, "guidance_scale": 1.0})
    torch.testing.assert_close(
        unguided, theirs(generator=torch.Generator().manual_seed(7), guidance_scale=1.0), rtol=0, atol=1e-6
    )
    assert torch.equal(ours, model.generate(PROMPTS, seed=7, **settings))
    assert not torch.equal(ours, model.generate(PROMPTS, seed=8, **settings))
    with pytest.raises(ValueError, match="'euler'"):
        model.generate(PROMPTS, sampler="ddim")


@pytest.mark.heavy
def test_pretrained_sd3_folder_loads_every_part_and_t5_only_when_named(model, tmp_path):
    """A StableDiffusion3Pipeline folder (diffusers' own save_pretrained, with a toy T5): the default
    components load the transformer, VAE (scale and shift from its config), both CLIPs and tokenizers;
    naming text_encoder_3 adds T5, whose embeddings then fill the T5 part as the pipeline's do."""
    from transformers import T5Config, T5EncoderModel

    tokenizer_3 = build_t5_tokenizer()
    torch.manual_seed(4)
    config = dict(PRESETS["mmdit-tiny"]["text_encoder_3"], vocab_size=len(tokenizer_3))
    pipe = _pipeline(model)
    pipe.text_encoder_3, pipe.tokenizer_3 = T5EncoderModel(T5Config(**config)).eval(), tokenizer_3
    pipe.vae.register_to_config(shift_factor=0.1)
    try:
        pipe.save_pretrained(tmp_path)
    finally:
        pipe.vae.register_to_config(shift_factor=0.0)

    loaded = build_model("mmdit-tiny", pretrained=str(tmp_path))
    assert loaded.text_encoder_3 is None and loaded.tokenizer_3 is None  # T5 stays off by default
    assert float(loaded.latent_shift) == pytest.approx(0.1) and float(loaded.latent_scale) == pytest.approx(
        0.18215
    )
    for name in ("transformer", "vae", "text_encoder", "text_encoder_2"):
        theirs = getattr(model, name).state_dict()
        assert all(v.equal(theirs[k]) for k, v in getattr(loaded, name).state_dict().items()), name
    assert loaded.text_encoder.config.projection_dim == 32  # with its projection

    with_t5 = build_model(
        "mmdit-tiny",
        pretrained=str(tmp_path),
        pretrained_components=["vae", "text_encoder", "tokenizer", "text_encoder_3"],
    )
    assert isinstance(with_t5.text_encoder_3, T5EncoderModel) and not with_t5.text_encoder_3.training
    pipe = _pipeline(with_t5)
    embeds, negative, pooled, _ = pipe.encode_prompt(PROMPTS, None, None, device="cpu", max_sequence_length=8)
    context, ours_pooled = with_t5.encode_captions(PROMPTS, "cpu")
    assert not context[:, 77:].eq(0).all()  # T5's embeddings, not zeros
    torch.testing.assert_close(context, embeds, rtol=0, atol=0)
    torch.testing.assert_close(ours_pooled, pooled, rtol=0, atol=0)
    torch.testing.assert_close(with_t5.empty_condition("cpu")[0], negative[:1])
    with pytest.raises(ValueError, match="input_ids_3"):
        with_t5.condition(_batch(with_t5), False)


def test_family_options_are_checked():
    with pytest.raises(ValueError, match="model.offset_noise is a DDPM option"):
        build_model("mmdit-tiny", offset_noise=0.1)
    with pytest.raises(ValueError, match="model.timestep_shift is a rectified-flow option"):
        build_model("tiny", timestep_shift=3.0)
    with pytest.raises(ValueError, match=r"unknown \['unet'\]"):
        build_model("mmdit-tiny", pretrained="/nowhere", pretrained_components=["unet"])
    with pytest.raises(ValueError, match=r"unknown \['transformer'\]"):
        build_model("sdxl-tiny", pretrained="/nowhere", pretrained_components=["transformer"])
    with pytest.raises(ValueError, match="T5 tokenizer cannot be built offline"):
        build_model("mmdit-tiny", pretrained_components=["text_encoder_3"])
    with pytest.raises(ValueError, match="loss_weighting"):
        build_model("mmdit-tiny", loss_weighting="uniform")
    assert isinstance(build_model("mmdit-tiny", gradient_checkpointing=True), RectifiedFlowTransformer)


@pytest.mark.heavy
def test_transformer_flops_match_a_closed_form_count():
    """The counter's FLOPs for the tiny transformer equal a count by formula: every Linear and the patch
    convolution 2 x MACs forward, twice that backward (once without an input gradient: latents, text,
    pooled vector and timestep embedding), and joint attention over image + text tokens (QK^T and AV,
    4 L^2 x width forward, twice that backward)."""
    from torch import nn

    from compat.diffusers import Attention

    with torch.device("meta"):
        transformer = build_components("mmdit-tiny")["transformer"]
    total = 0

    def dense(module, args, out):
        nonlocal total
        x = args[0]
        if isinstance(module, nn.Conv2d):
            c_out, c_in, kh, kw = module.weight.shape
            forward = 2 * out.shape[0] * c_out * c_in * kh * kw * out.shape[2] * out.shape[3]
        else:
            forward = 2 * (x.numel() // x.shape[-1]) * module.in_features * module.out_features
        total += forward * (3 if x.requires_grad else 2)

    def attention(module, args, kwargs, out):
        nonlocal total
        x, context = kwargs["hidden_states"], kwargs.get("encoder_hidden_states")
        tokens = x.shape[1] + (0 if context is None else context.shape[1])
        total += 3 * 4 * x.shape[0] * tokens * tokens * module.inner_dim

    for module in transformer.modules():
        if isinstance(module, nn.Conv2d | nn.Linear):
            module.register_forward_hook(dense)
        elif isinstance(module, Attention):
            module.register_forward_hook(attention, with_kwargs=True)
    config = transformer.config
    with torch.device("meta"):
        transformer(
            hidden_states=torch.randn(1, 4, 8, 8),
            timestep=torch.tensor([500.0]),
            encoder_hidden_states=torch.randn(1, 85, config.joint_attention_dim),
            pooled_projections=torch.randn(1, config.pooled_projection_dim),
        )
    assert training_flops_per_image("mmdit-tiny", 32) == pytest.approx(total, rel=1e-3)


@pytest.mark.heavy  # counts the full-size transformer at two resolutions (~5 s)
def test_sd3_medium_flops_are_plausible():
    """Per token, the 24 blocks' two streams hold ~12 x 1536^2 weights each (attention 4, MLP 8):
    6 x 679 M FLOPs per token trained; 256 px is 256 image + 154 text tokens, 1024 px 4096 + 154;
    joint attention adds 12 x 24 x L^2 x 1536 (~0.07 TFLOP at 256 px, ~8 at 1024)."""
    low, high = training_flops_per_image("sd3-medium", 256), training_flops_per_image("sd3-medium", 1024)
    assert 1.6e12 < low < 1.9e12
    assert 23e12 < high < 27e12
    with pytest.raises(ValueError, match="multiple of 16"):
        training_flops_per_image("sd3-medium", 264)


@pytest.mark.heavy
def test_one_fsdp_unit_and_checkpointed_unit_per_transformer_block():
    with torch.device("meta"):
        transformer = build_components("sd3-medium")["transformer"]
    assert sharding.units(transformer, "unet") == []
    blocks = sharding.units(transformer, "blocks")
    assert len(blocks) == 24 and blocks == sharding.units(transformer, "layers")
    assert all(count(b) == count(blocks[0]) for b in blocks[:-1])  # the last one's text stream ends early
    sharding.configure(transformer, "blocks", "blocks")
    assert transformer.fsdp_wrap_fn(blocks[3]) and not transformer.fsdp_wrap_fn(transformer.pos_embed)
    assert transformer.activation_checkpointing_fn(blocks[0]) and not transformer.activation_checkpointing_fn(
        transformer
    )
    model = build_model("mmdit-tiny")
    assert model.transformer._fsdp_wrap and not any(
        getattr(model, name)._fsdp_wrap for name in ("vae", "text_encoder", "text_encoder_2")
    )


@pytest.mark.heavy
def test_checkpointed_blocks_give_the_same_gradients():
    """What Composer applies under FSDP with activation_checkpointing (each block recomputed), without
    FSDP: the transformer's gradients do not change."""
    from compat.torch import apply_activation_checkpointing

    torch.manual_seed(0)
    plain = build_model("mmdit-tiny").transformer
    checkpointed = build_model("mmdit-tiny", activation_checkpointing="blocks").transformer
    checkpointed.load_state_dict(plain.state_dict())
    apply_activation_checkpointing(checkpointed, check_fn=checkpointed.activation_checkpointing_fn)
    assert sum(type(m).__name__ == "CheckpointWrapper" for m in checkpointed.modules()) == 4
    generator = torch.Generator().manual_seed(1)
    inputs = dict(
        hidden_states=torch.randn(2, 4, 8, 8, generator=generator),
        timestep=torch.tensor([10.0, 500.0]),
        encoder_hidden_states=torch.randn(2, 85, 128, generator=generator),
        pooled_projections=torch.randn(2, 64, generator=generator),
    )
    for transformer in (plain, checkpointed):
        transformer(**inputs).sample.square().mean().backward()
    for (name, p), (_, q) in zip(plain.named_parameters(), checkpointed.named_parameters(), strict=True):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-5, atol=1e-7, msg=name)


@pytest.mark.fit
def test_tiny_mmdit_recipe_trains_on_the_shapes(shapes_mds):
    """yamls/tiny-mmdit-cpu.yaml, shortened: the data path hands over both CLIPs' token ids, and the
    loss goes down over 8 batches."""
    from composer import Callback

    trainer = build_trainer(load_config(REPO / "yamls/tiny-mmdit-cpu.yaml", tiny_run(shapes_mds, 8)))
    assert isinstance(trainer.state.model, RectifiedFlowTransformer)
    losses = []

    class Losses(Callback):
        def after_loss(self, state, logger):
            losses.append(float(state.loss))

        def before_forward(self, state, logger):
            assert {"input_ids", "input_ids_2"} <= state.batch.keys()

    trainer.state.callbacks.append(Losses())
    trainer.fit()
    trainer.close()
    assert len(losses) == 8 and all(torch.isfinite(torch.tensor(losses)))
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3
