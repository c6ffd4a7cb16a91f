"""models/engine/objectives.py: DDPM and rectified flow against hand computations of their formulas, their
random draws (order, determinism, per-sample seeding) and the schedulers they sample with."""

import math

import pytest
import torch
from diffusers import DDIMScheduler, DDPMScheduler, EulerDiscreteScheduler, FlowMatchEulerDiscreteScheduler

from models.engine.objectives import DDPM, FlowOptions, RectifiedFlow, seeded_draws, seeded_flow_draws
from models.registry import PRESETS

SHAPE = (3, 4, 2, 2)  # a batch of 3 latents, 4 channels, 2 x 2


def _ddpm_scheduler(**config) -> DDPMScheduler:
    return DDPMScheduler.from_config(PRESETS["tiny"]["scheduler"], **config)


def _alphas_cumprod(objective: DDPM) -> torch.Tensor:
    """alpha_bar from the betas, in float64: the schedule by hand, not through the scheduler's tensor."""
    return torch.cumprod(1 - objective.scheduler.betas.double(), dim=0)


def _latents_and_draws(objective, seed=0):
    torch.manual_seed(seed)
    x0 = torch.randn(SHAPE)
    return x0, objective.draws(x0)


@pytest.mark.parametrize("prediction_type", ["epsilon", "v_prediction"])
def test_ddpm_noisy_input_and_target(prediction_type):
    objective = DDPM(_ddpm_scheduler(), prediction_type, offset_noise=0.3)
    x0, draws = _latents_and_draws(objective)
    noisy, timesteps, target, level = objective.diffuse(x0, draws)
    a = _alphas_cumprod(objective)[draws["timesteps"]].view(-1, 1, 1, 1)
    noise = draws["noise"].double() + 0.3 * draws["offset"].double()  # offset: one constant per channel
    assert draws["offset"].shape == (3, 4, 1, 1)
    torch.testing.assert_close(noisy.double(), a.sqrt() * x0 + (1 - a).sqrt() * noise, rtol=1e-5, atol=1e-6)
    expected = noise if prediction_type == "epsilon" else a.sqrt() * noise - (1 - a).sqrt() * x0
    torch.testing.assert_close(target.double(), expected, rtol=1e-5, atol=1e-6)
    assert torch.equal(timesteps, draws["timesteps"]) and torch.equal(level, timesteps)


@pytest.mark.parametrize("prediction_type", ["epsilon", "v_prediction"])
def test_min_snr_weight_and_loss(prediction_type):
    objective = DDPM(_ddpm_scheduler(), prediction_type, min_snr_gamma=5.0)
    timesteps = torch.tensor([0, 100, 500, 999])
    a = _alphas_cumprod(objective)[timesteps]
    snr = a / (1 - a)
    assert snr[0] > 5 > snr[-1]  # both sides of gamma
    expected = snr.clamp(max=5.0) / (snr if prediction_type == "epsilon" else snr + 1)
    # alpha_bar is fp32: near 1 (timestep 0, SNR ~ 1e3) its 1 - alpha_bar is good to ~1e-5 relative
    torch.testing.assert_close(objective.weight(timesteps).double(), expected, rtol=1e-4, atol=0)

    prediction, target = torch.randn(4, 4, 2, 2), torch.randn(4, 4, 2, 2)
    per_sample = ((prediction - target) ** 2).mean(dim=(1, 2, 3)).double()
    loss = objective.loss(prediction, target, timesteps)
    torch.testing.assert_close(loss.double(), (per_sample * expected).mean(), rtol=1e-4, atol=0)
    objective.min_snr_gamma = None
    assert objective.weight(timesteps) is None
    torch.testing.assert_close(objective.loss(prediction, target, timesteps).double(), per_sample.mean())


def test_zero_terminal_snr_comes_from_the_scheduler():
    rescaled = _ddpm_scheduler(rescale_betas_zero_snr=True)
    with pytest.raises(ValueError, match="ends at zero SNR"):
        DDPM(rescaled, "epsilon")
    objective = DDPM(rescaled, "v_prediction", min_snr_gamma=5.0)
    assert objective.zero_terminal_snr and not DDPM(_ddpm_scheduler()).zero_terminal_snr
    last = torch.tensor([999])
    assert objective.weight(last).item() == 0  # min(0, gamma) / (0 + 1): finite
    x0 = torch.randn(1, 4, 2, 2)
    noisy, _, target, _ = objective.diffuse(x0, {"noise": torch.ones(1, 4, 2, 2), "timesteps": last})
    assert torch.equal(noisy, torch.ones(1, 4, 2, 2)) and torch.equal(target, -x0)  # pure noise; v = -x0


def test_ddpm_training_draws_come_from_the_global_rng_in_order():
    objective = DDPM(_ddpm_scheduler(), offset_noise=0.1)
    x0, draws = _latents_and_draws(objective, seed=3)
    torch.manual_seed(3)
    torch.randn(SHAPE)  # x0
    assert torch.equal(draws["noise"], torch.randn(SHAPE))
    assert torch.equal(draws["offset"], torch.randn(3, 4, 1, 1))
    assert torch.equal(draws["timesteps"], torch.randint(0, 1000, (3,)))
    # Without offset noise no offset is drawn, and the timesteps follow the noise.
    _, plain = _latents_and_draws(DDPM(_ddpm_scheduler()), seed=3)
    assert "offset" not in plain and torch.equal(plain["noise"], draws["noise"])


def test_seeded_draws_are_deterministic_and_per_sample():
    ddpm, flow = DDPM(_ddpm_scheduler()), RectifiedFlow(FlowMatchEulerDiscreteScheduler())
    for objective, keys in (
        (ddpm, ["latent", "noise", "timesteps", "offset"]),
        (flow, ["latent", "noise", "normal"]),
    ):
        pair = objective.seeded_draws([11, 12], SHAPE[1:], "cpu")
        assert list(pair) == keys
        again = objective.seeded_draws([11, 12], SHAPE[1:], "cpu")
        assert all(torch.equal(pair[k], again[k]) for k in keys)
        # A sample's draws are its seed's, whatever else is in the batch and wherever it is.
        alone, swapped = (
            objective.seeded_draws([12], SHAPE[1:], "cpu"),
            objective.seeded_draws([12, 11], SHAPE[1:], "cpu"),
        )
        assert all(
            torch.equal(pair[k][1], alone[k][0]) and torch.equal(pair[k][0], swapped[k][1]) for k in keys
        )
        assert not torch.equal(pair["noise"][0], pair["noise"][1])
    # The draws' order: the latent and noise first (the same for both objectives), DDPM's offset last.
    generator = torch.Generator().manual_seed(11)
    latent, noise = torch.randn(SHAPE[1:], generator=generator), torch.randn(SHAPE[1:], generator=generator)
    timestep = torch.randint(0, 1000, (), generator=generator)
    offset = torch.randn(4, 1, 1, generator=generator)
    ddpm_draws = seeded_draws([11], SHAPE[1:], 1000, "cpu")
    flow_draws = seeded_flow_draws([11], SHAPE[1:], "cpu")
    for draws in (ddpm_draws, flow_draws):
        assert torch.equal(draws["latent"][0], latent) and torch.equal(draws["noise"][0], noise)
    assert torch.equal(ddpm_draws["timesteps"][0], timestep) and torch.equal(ddpm_draws["offset"][0], offset)


def test_flow_noisy_input_target_and_timesteps():
    objective = RectifiedFlow(
        FlowMatchEulerDiscreteScheduler(shift=3.0), FlowOptions(timestep_mean=0.5, timestep_std=0.8)
    )
    x0, draws = _latents_and_draws(objective)
    noisy, timesteps, target, t = objective.diffuse(x0, draws, (32, 32))
    u = torch.sigmoid(0.5 + 0.8 * draws["normal"].double())
    expected_t = 3 * u / (1 + 2 * u)  # SD3 eq. 23 with s = 3
    torch.testing.assert_close(t.double(), expected_t)
    sigma = expected_t.view(-1, 1, 1, 1)
    torch.testing.assert_close(
        noisy.double(), (1 - sigma) * x0 + sigma * draws["noise"], rtol=1e-5, atol=1e-6
    )
    torch.testing.assert_close(timesteps.double(), 1000 * expected_t)
    assert torch.equal(target, draws["noise"] - x0)


@pytest.mark.parametrize("weighting, at_half", [(None, None), ("sigma_sqrt", 4.0), ("cosmap", 4 / math.pi)])
def test_flow_loss_weighting(weighting, at_half):
    objective = RectifiedFlow(FlowMatchEulerDiscreteScheduler(), FlowOptions(loss_weighting=weighting))
    t = torch.tensor([0.5, 0.2])
    prediction, target = torch.randn(2, 4, 2, 2), torch.randn(2, 4, 2, 2)
    per_sample = ((prediction - target) ** 2).mean(dim=(1, 2, 3))
    if weighting is None:
        assert objective.weight(t) is None
        torch.testing.assert_close(objective.loss(prediction, target, t), per_sample.mean())
        return
    weight = objective.weight(t)
    assert weight[0].item() == pytest.approx(at_half)
    by_hand = 0.2**-2 if weighting == "sigma_sqrt" else 2 / (math.pi * (1 - 0.4 + 0.08))
    assert weight[1].item() == pytest.approx(by_hand)
    torch.testing.assert_close(objective.loss(prediction, target, t), (per_sample * weight).mean())


def test_ddpm_sampler_keeps_the_schedule():
    objective = DDPM(_ddpm_scheduler(), "v_prediction")
    assert type(objective.scheduler) is DDPMScheduler
    assert objective.scheduler.config.prediction_type == "v_prediction"
    # Rebuilt with it, not registered: another class's from_config keeps it (the exported sampler).
    assert "prediction_type" not in objective.scheduler.config.get("_use_default_values", [])
    for name, cls in (("ddim", DDIMScheduler), ("euler", EulerDiscreteScheduler)):
        sampler = objective.sampler(name)
        assert type(sampler) is cls and sampler.config.prediction_type == "v_prediction"
        torch.testing.assert_close(sampler.alphas_cumprod, objective.scheduler.alphas_cumprod)
    with pytest.raises(ValueError, match="unknown sampler 'heun'"):
        objective.sampler("heun")
    with pytest.raises(ValueError, match="prediction_type must be"):
        DDPM(_ddpm_scheduler(), "sample")


@pytest.mark.parametrize("option, at_512", [(None, 3.0), (2.0, 2.0), ("auto", 2.0)])
def test_flow_shift_is_the_samplers(option, at_512):
    objective = RectifiedFlow(FlowMatchEulerDiscreteScheduler(shift=3.0), FlowOptions(timestep_shift=option))
    assert objective.shift_for((512, 512)) == pytest.approx(at_512)
    sampler = objective.sampler((512, 512))
    assert type(sampler) is FlowMatchEulerDiscreteScheduler and sampler.config.shift == pytest.approx(at_512)
    # Its sigmas are the training timesteps' shift (eq. 23) applied to the unshifted ones.
    u = FlowMatchEulerDiscreteScheduler(shift=1.0).sigmas.double()
    torch.testing.assert_close(sampler.sigmas.double(), at_512 * u / (1 + (at_512 - 1) * u))


def test_flow_options_refused():
    scheduler = FlowMatchEulerDiscreteScheduler()
    with pytest.raises(ValueError, match="timestep_std must be positive"):
        RectifiedFlow(scheduler, FlowOptions(timestep_std=0))
    for shift in (0, -1.0, "big", True):
        with pytest.raises(ValueError, match="timestep_shift must be"):
            RectifiedFlow(scheduler, FlowOptions(timestep_shift=shift))
    with pytest.raises(ValueError, match="loss_weighting='snr'"):
        RectifiedFlow(scheduler, FlowOptions(loss_weighting="snr"))
    with pytest.raises(TypeError, match="FlowMatchEulerDiscreteScheduler, not DDPMScheduler"):
        RectifiedFlow(_ddpm_scheduler())
    with pytest.raises(ValueError, match="use_dynamic_shifting"):
        RectifiedFlow(FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True))


@pytest.mark.heavy
def test_models_forward_their_objective_attributes():
    from models import build_model

    model = build_model("tiny", prediction_type="v_prediction", min_snr_gamma=5.0)
    assert model.noise_scheduler is model.objective.scheduler and model.prediction_type == "v_prediction"
    model.min_snr_gamma = None  # set on the model, read by the loss
    assert model.objective.min_snr_gamma is None
    flow = build_model("mmdit-tiny", timestep_shift="auto")
    assert isinstance(flow.objective, RectifiedFlow) and flow.timestep_shift == "auto"
    flow.noise_scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0)
    flow.timestep_shift = None
    assert flow.shift_for((32, 32)) == 3.0 and flow.sampling_scheduler((32, 32)).config.shift == 3.0
