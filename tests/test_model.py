import pytest
import torch
from diffusers import DDPMScheduler

import models
from models import build_model
from models.components import build_components
from models.engine.tokenizer import tokenize
from models.registry import PRESETS
from tests.conftest import REPO


def test_packages_are_the_repos_own():
    assert models.__file__.startswith(str(REPO))


def test_sd2_base_has_the_published_schedule():
    """(Its parameter counts: tests/test_families.py.)"""
    with torch.device("meta"):  # no memory, no init time
        parts = build_components("sd2-base")
    config = parts["noise_scheduler"].config
    assert (config.beta_schedule, config.beta_start, config.beta_end) == ("scaled_linear", 0.00085, 0.012)
    assert config.num_train_timesteps == 1000


@pytest.mark.parametrize(
    "preset, unet, text_encoder, prediction, pad",
    [
        ("sd15", 859_520_964, 123_060_480, "epsilon", "<|endoftext|>"),  # runwayml/stable-diffusion-v1-5
        ("sd2-768-v", 865_910_724, 340_387_840, "v_prediction", "!"),  # stabilityai/stable-diffusion-2
    ],
)
@pytest.mark.heavy
def test_other_published_architectures(preset, unet, text_encoder, prediction, pad):
    from accelerate import init_empty_weights

    with init_empty_weights():  # parameters on the meta device: no memory, no init time
        model = build_model(preset)
    assert count(model.unet) == unet and count(model.text_encoder) == text_encoder
    assert count(model.vae) == 83_653_863  # SD1 and SD2 share the VAE architecture
    assert model.prediction_type == prediction and model.tokenizer.pad_token == pad
    assert model.noise_scheduler.config.prediction_type == prediction
    size = {"sd15": 512, "sd2-768-v": 768}[preset]
    assert model.unet.config.sample_size * model.vae_scale_factor == size


def count(module) -> int:
    return sum(p.numel() for p in module.parameters())


def same(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


def _batch(model, n=2, size=32, captions=("a red circle", "a blue square")):
    torch.manual_seed(0)
    return {
        "image": torch.rand(n, 3, size, size) * 2 - 1,
        "input_ids": tokenize(model.tokenizer, captions[:n]),
    }


def _loss(model, batch, seed=1):
    torch.manual_seed(seed)
    return model.loss(model(batch), batch)


def test_uint8_images_train_and_validate_as_their_floats():
    """The data loader hands over uint8; the model converts on the device, bit for bit as the loader's
    float path would have (models/engine/pixels.py)."""
    from models.engine.pixels import to_float

    model = build_model("tiny")
    model.train()
    batch = _batch(model)
    uint8 = {**batch, "image": torch.randint(0, 256, batch["image"].shape, dtype=torch.uint8)}
    floats = {**batch, "image": to_float(uint8["image"])}
    assert floats["image"].min() >= -1 and floats["image"].max() <= 1
    assert torch.equal(_loss(model, uint8), _loss(model, floats))
    assert model.eval_seeds(uint8) == model.eval_seeds(floats)
    assert to_float(floats["image"]) is floats["image"]  # floats pass through


def test_v_prediction_target():
    model = build_model("tiny", prediction_type="v_prediction")
    batch = _batch(model)
    torch.manual_seed(1)
    _, v, t = model(batch)
    torch.manual_seed(1)
    moments = model.vae_moments(batch["image"])
    latents = model.sample_latents(moments)
    noise = torch.randn(latents.shape)
    alphas = model.noise_scheduler.alphas_cumprod[t].view(-1, 1, 1, 1)
    torch.testing.assert_close(v, alphas.sqrt() * noise - (1 - alphas).sqrt() * latents)


@pytest.mark.heavy
def test_offset_noise_shifts_each_channel_by_a_constant():
    batch = _batch(build_model("tiny"))
    torch.manual_seed(2)
    plain = build_model("tiny")
    offset = build_model("tiny", offset_noise=0.5)
    offset.load_state_dict(plain.state_dict())
    torch.manual_seed(1)
    _, target_plain, _ = plain(batch)
    torch.manual_seed(1)
    _, target_offset, _ = offset(batch)
    diff = target_offset - target_plain
    assert diff.abs().max() > 0.01
    torch.testing.assert_close(diff, diff[..., :1, :1].expand_as(diff))


def _sd2_alphas_cumprod() -> torch.Tensor:
    """SD2's alpha-bar by definition: "scaled_linear" betas (linear in sqrt(beta) from 0.00085 to 0.012
    over 1000 steps), cumulative product of 1 - beta; float64."""
    betas = torch.linspace(0.00085**0.5, 0.012**0.5, 1000, dtype=torch.float64) ** 2
    return torch.cumprod(1 - betas, dim=0)


@pytest.mark.parametrize("prediction_type", ["epsilon", "v_prediction"])
def test_min_snr_gamma_weights(prediction_type):
    # Hang et al. 2023 weight the x0 loss by min(SNR, gamma); as an epsilon loss that is
    # min(SNR, gamma) / SNR, as a v loss min(SNR, gamma) / (SNR + 1) (|v - v'|^2 = (SNR + 1) |x0 - x0'|^2),
    # as diffusers' train_text_to_image.py has it.
    gamma = 5.0
    model = build_model("tiny", prediction_type=prediction_type, min_snr_gamma=gamma)
    t = torch.tensor([0, 20, 100, 300, 600, 999])
    alpha_bar = _sd2_alphas_cumprod()[t]
    snr = alpha_bar / (1 - alpha_bar)
    clamped = snr > gamma
    assert clamped.any() and not clamped.all()  # both sides of the min
    weight = snr.clamp(max=gamma) / (snr if prediction_type == "epsilon" else snr + 1)
    # Where SNR < gamma the weight is 1 (epsilon) or alpha_bar (v); above, gamma / SNR or gamma / (SNR + 1).
    unclamped_weight = 1.0 if prediction_type == "epsilon" else alpha_bar[~clamped]
    torch.testing.assert_close(weight[~clamped], torch.ones_like(weight[~clamped]) * unclamped_weight)

    torch.manual_seed(0)
    prediction, target = torch.randn(2, len(t), 4, 8, 8).unbind(0)
    per_sample = ((prediction - target) ** 2).mean(dim=(1, 2, 3)).double()
    expected = (per_sample * weight).mean().float()
    torch.testing.assert_close(model.loss((prediction, target, t), {}), expected, rtol=1e-5, atol=0)

    # Through the forward pass: the loss of a real batch is the weighted mean at its own timesteps.
    batch = _batch(model)
    torch.manual_seed(1)
    outputs = model(batch)
    prediction, target, t = outputs
    alpha_bar = _sd2_alphas_cumprod()[t]
    snr = alpha_bar / (1 - alpha_bar)
    weight = snr.clamp(max=gamma) / (snr if prediction_type == "epsilon" else snr + 1)
    per_sample = ((prediction - target) ** 2).mean(dim=(1, 2, 3)).double()
    loss = model.loss(outputs, batch)
    torch.testing.assert_close(loss, (per_sample * weight).mean().float(), rtol=1e-5, atol=0)
    model.min_snr_gamma = None
    torch.testing.assert_close(model.loss(outputs, batch), per_sample.mean().float(), rtol=1e-5, atol=0)


@pytest.mark.heavy
def test_zero_terminal_snr(monkeypatch, tmp_path):
    original = _sd2_alphas_cumprod()
    plain = build_model("tiny").noise_scheduler.alphas_cumprod
    torch.testing.assert_close(plain.double(), original, rtol=1e-5, atol=0)  # SD2's own schedule...
    assert plain[-1] > 1e-3  # ... whose last step still leaves signal in the input

    model = build_model("tiny", prediction_type="v_prediction", zero_terminal_snr=True)
    alpha_bar = model.noise_scheduler.alphas_cumprod
    # Lin et al. 2023, Algorithm 1: shift sqrt(alpha_bar) so the last is 0, scale so the first is
    # unchanged; an affine map of the original sqrt(alpha_bar).
    root = original.sqrt()
    expected = (root - root[-1]) * root[0] / (root[0] - root[-1])
    assert alpha_bar[-1] == 0  # exactly: pure noise at the last timestep
    assert alpha_bar[0].item() == pytest.approx(original[0].item(), rel=1e-6)
    torch.testing.assert_close(alpha_bar.double().sqrt(), expected, rtol=1e-4, atol=1e-6)
    assert (alpha_bar.diff() < 0).all()  # every step adds noise

    # Training at the terminal timestep: the UNet sees pure noise and the v target is -x0; the loss
    # is finite (also with min-SNR weighting, whose v weight is 0 / (0 + 1) there) and so are the gradients.
    last = model.noise_scheduler.config.num_train_timesteps - 1
    drawn = []

    def terminal(low, high, size, device=None, **kwargs):
        drawn.append(size)
        return torch.full(size, last, dtype=torch.long, device=device)

    monkeypatch.setattr(torch, "randint", terminal)
    unet_inputs = []
    model.unet.register_forward_pre_hook(lambda module, args: unet_inputs.append(args[0].detach()))
    model.min_snr_gamma = 5.0
    model.train()
    batch = _batch(model)
    torch.manual_seed(1)
    outputs = model(batch)
    torch.manual_seed(1)
    latents = model.sample_latents(model.vae_moments(batch["image"]))
    noise = torch.randn(latents.shape)
    assert drawn and (outputs[2] == last).all()
    torch.testing.assert_close(unet_inputs[0], noise)
    torch.testing.assert_close(outputs[1], -latents)
    for gamma in (None, 5.0):
        model.min_snr_gamma = gamma
        loss = model.loss(outputs, batch)
        assert torch.isfinite(loss)
    model.min_snr_gamma = None
    model.loss(outputs, batch).backward()
    assert all(torch.isfinite(p.grad).all() for p in model.unet.parameters())

    # Epsilon is undefined at SNR 0: refused, whether the flag or a loaded scheduler asks for it.
    with pytest.raises(ValueError, match="zero_terminal_snr needs prediction_type=v_prediction"):
        build_model("tiny", zero_terminal_snr=True)
    DDPMScheduler.from_config(PRESETS["tiny"]["scheduler"], rescale_betas_zero_snr=True).save_pretrained(
        tmp_path / "scheduler"
    )
    with pytest.raises(ValueError, match="zero SNR"):
        build_model("tiny", pretrained=str(tmp_path), pretrained_components=["scheduler"])
    loaded = build_model(
        "tiny", pretrained=str(tmp_path), pretrained_components=["scheduler"], prediction_type="v_prediction"
    )
    assert loaded.noise_scheduler.alphas_cumprod[-1] == 0


@pytest.mark.heavy
def test_pretrained_components_from_a_local_folder(tmp_path):
    source = build_model("tiny")
    for name in ("unet", "vae", "text_encoder", "tokenizer"):
        getattr(source, name).save_pretrained(tmp_path / name)
    torch.manual_seed(123)  # a different random init than `source`
    model = build_model("tiny", pretrained=str(tmp_path), pretrained_components=["vae", "text_encoder"])
    assert same(model.vae, source.vae) and same(model.text_encoder, source.text_encoder)
    assert not same(model.unet, source.unet)
    everything = build_model("tiny", pretrained=str(tmp_path))
    assert same(everything.unet, source.unet)
    with pytest.raises(FileNotFoundError, match="no/such/folder"):
        build_model("tiny", pretrained="./no/such/folder")
    (tmp_path / "unet").rename(tmp_path / "moved")
    with pytest.raises(FileNotFoundError, match="no 'unet/' folder"):
        build_model("tiny", pretrained=str(tmp_path))


def test_speed_and_memory_switches():
    from compat.composer import LPGroupNorm
    from compat.diffusers import AttnProcessor, AttnProcessor2_0

    default = build_model("tiny")
    assert all(isinstance(p, AttnProcessor2_0) for p in default.unet.attn_processors.values())
    assert default.unet._fsdp_wrap and not default.vae._fsdp_wrap and not default.text_encoder._fsdp_wrap
    # Composer's FSDP moves only what it wraps; the trainer moves the rest (meta: no GPU here).
    from recipes.trainer import place_unsharded

    place_unsharded(default, torch.device("meta"))
    frozen = [*default.vae.parameters(), *default.text_encoder.parameters()]
    assert {p.device.type for p in frozen} == {"meta"}
    assert {p.device.type for p in default.unet.parameters()} == {"cpu"}
    model = build_model(
        "tiny",
        gradient_checkpointing=True,
        channels_last=True,
        attention="math",
        low_precision_norms="amp_bf16",
    )
    assert model.unet.is_gradient_checkpointing
    assert model.unet.conv_in.weight.is_contiguous(memory_format=torch.channels_last)
    assert all(isinstance(p, AttnProcessor) for p in model.unet.attn_processors.values())
    assert any(isinstance(m, LPGroupNorm) for m in model.unet.modules())
    model.train()
    loss = _loss(model, _batch(model))
    loss.backward()
    assert torch.isfinite(loss) and model.unet.conv_in.weight.grad is not None


@pytest.mark.parametrize("sampler", ["ddim", "euler", "dpm++"])
@pytest.mark.heavy
def test_generate_is_seeded(sampler):
    model = build_model("tiny")
    a = model.generate(["a red circle"], num_inference_steps=3, seed=1, sampler=sampler)
    b = model.generate(["a red circle"], num_inference_steps=3, seed=1, sampler=sampler)
    c = model.generate(["a red circle"], num_inference_steps=3, seed=2, sampler=sampler)
    assert a.shape == (1, 3, 32, 32) and 0 <= a.min() and a.max() <= 1
    assert torch.equal(a, b) and not torch.equal(a, c)


@pytest.mark.parametrize("preset", ["tiny", "sdxl-tiny", "flux-tiny"])
@pytest.mark.heavy
def test_a_checkpoint_of_transformers_4_loads(preset):
    """Checkpoints written before the move to transformers 5 name a CLIPTextModel's weights
    `text_encoder.text_model.*` (5 dropped that level; CLIPTextModelWithProjection keeps it): they
    still load, strictly, into every family that has one."""
    torch.manual_seed(0)
    state = build_model(preset).state_dict()
    clip = [k for k in state if k.startswith("text_encoder.")]
    assert clip and not any(k.startswith("text_encoder.text_model.") for k in state)
    old = {
        (k.replace("text_encoder.", "text_encoder.text_model.", 1) if k in clip else k): v
        for k, v in state.items()
    }
    torch.manual_seed(1)
    model = build_model(preset)
    assert not model.text_encoder.embeddings.token_embedding.weight.equal(
        state["text_encoder.embeddings.token_embedding.weight"]
    )
    model.load_state_dict(old, strict=True)
    assert all(v.equal(state[k]) for k, v in model.state_dict().items())
