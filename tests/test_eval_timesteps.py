"""`model.eval_timesteps: K`: each validation sample at one of K fixed, evenly spaced timesteps, picked
by its eval seed, with its own seeded noise (MLPerf's Flux rule, models/engine/eval_timesteps.py), for every
family of the conformance suite (tests/test_families.py FAMILIES)."""

from types import SimpleNamespace

import pytest
import torch
from torch.utils.data import default_collate

from models import build_model
from models.engine.eval_timesteps import FixedTimestepLoss, level_indices
from models.engine.latent_diffusion import LatentDiffusion
from recipes import load_config, parse_config
from recipes.config import ConfigError
from tests.conftest import REPO
from tests.test_families import FAMILIES, _checkpoint, _model, _read

K = 8  # MLPerf's


@pytest.fixture(scope="module", params=list(FAMILIES.values()), ids=list(FAMILIES))
def family(request, shapes_mds):
    """(the preset's model without and with eval_timesteps, from the same weights; a batch of the
    first shapes as its loader gives them)."""
    preset = request.param
    plain, fixed = _model(preset).eval(), _model(preset, eval_timesteps=K).eval()
    batch = default_collate([sample for _, sample in _read(plain, preset, shapes_mds / "mds").values()])
    return plain, fixed, batch


@torch.no_grad()
@pytest.mark.heavy
def test_each_sample_keeps_one_of_k_timesteps_and_its_own_noise(family):
    plain, fixed, batch = family
    seeds = fixed.eval_seeds(batch)
    prediction, target, level = fixed.eval_forward(batch)
    # Its eval seed picks the timestep: one of the K levels, the same the sample gets in any batch.
    assert torch.equal(level.cpu(), fixed.eval_levels[torch.tensor(seeds) % K])
    half = fixed.eval_forward({key: value[:2] for key, value in batch.items()})
    assert torch.equal(half[2], level[:2]) and torch.equal(half[1], target[:2])
    # The noise (and the latent sample) are the sample's own, as without eval_timesteps; only the
    # timestep differs. (The target is the noise, or noise - x0: neither depends on the timestep.)
    random_level = plain.eval_forward(batch)
    assert torch.equal(random_level[1], target)
    assert not torch.equal(random_level[2], level)
    assert not torch.equal(random_level[0], prediction)  # the denoiser saw the other timesteps


@torch.no_grad()
@pytest.mark.heavy
def test_the_validation_loss_is_the_same_number_for_a_checkpoint(family, tmp_path):
    from models.export import load_model_from_checkpoint

    _, model, batch = family

    def loss(m) -> torch.Tensor:
        metric = m.get_metrics()["FixedTimestepLoss"]
        m.update_metric(batch, m.eval_forward(batch), metric)
        return metric.compute()

    first = loss(model)
    torch.rand(1000)  # training would have moved the global RNG on
    model.train()
    model(batch)  # a training forward: global draws, dropped captions
    model.eval()
    assert torch.equal(loss(model), first)
    loaded = load_model_from_checkpoint(_checkpoint(model, tmp_path / "ckpt.pt"))
    loaded.set_eval_timesteps(K)  # a run's config sets it; the checkpoint holds weights, not this
    assert torch.equal(loss(loaded.eval()), first)
    assert torch.isfinite(first) and first > 0


def test_the_levels_are_mlperf_s_on_each_objective():
    # mlcommons/training text_to_image/README.md, "Quality metric": "8 equidistant time steps [0, 7/8]",
    # the sample's integer divided by 8.0; a DDPM schedule of T steps gets the same fractions of it.
    flow = build_model("mmdit-tiny", eval_timesteps=K).objective
    assert torch.equal(flow.fixed_levels(K), torch.tensor([i / 8 for i in range(8)]))
    ddpm = build_model("tiny").objective
    steps = ddpm.scheduler.config.num_train_timesteps
    assert torch.equal(ddpm.fixed_levels(K), torch.tensor([i * steps // 8 for i in range(8)]))
    assert torch.equal(ddpm.fixed_levels(3), torch.tensor([0, steps // 3, 2 * steps // 3]))
    with pytest.raises(ValueError, match=f"model.eval_timesteps={steps + 1} is more than"):
        ddpm.fixed_levels(steps + 1)


@pytest.mark.parametrize("k", [3, 8])
def test_the_assignment_is_a_function_of_the_sample_and_covers_the_k_levels_evenly(k):
    n = 4096
    generator = torch.Generator().manual_seed(0)
    batch = {"image": torch.rand(n, 3, 4, 4, generator=generator), "input_ids": torch.zeros(n, 3).long()}

    def assigned(eval_seed: int) -> torch.Tensor:
        return level_indices(LatentDiffusion.eval_seeds(SimpleNamespace(eval_seed=eval_seed), batch), k)

    levels = assigned(0)
    assert torch.equal(assigned(0), levels)
    counts = torch.bincount(levels, minlength=k)
    # Equally likely, so about n / k each: within 20% (about 5 standard deviations at k = 8).
    assert len(counts) == k and (counts - n / k).abs().max() < 0.2 * n / k, counts.tolist()
    # Another eval seed deals the samples again.
    assert not torch.equal(assigned(1), levels)


def test_the_metric_weights_the_timesteps_equally_whatever_their_counts():
    metric = FixedTimestepLoss(torch.tensor([0.0, 0.5]))
    zeros = torch.zeros(4, 1, 2, 2)
    # Three samples at t = 0 with loss 1, then one at t = 0.5 with loss 3: MLPerf's mean of the
    # per-timestep means is 2 (the plain mean of the four samples would be 1.5).
    metric.update(zeros[:3] + 1, zeros[:3], torch.tensor([0.0, 0.0, 0.0]))
    metric.update(zeros[:1] + 3**0.5, zeros[:1], torch.tensor([0.5]))
    assert metric.compute().item() == pytest.approx(2.0)
    assert metric.per_level().tolist() == pytest.approx([1.0, 3.0])
    with pytest.raises(ValueError, match="not one of the fixed levels"):
        metric.update(zeros[:1], zeros[:1], torch.tensor([0.25]))


@pytest.mark.parametrize("value", ["1", "eight", "true", "2.5"])
def test_a_wrong_eval_timesteps_is_a_one_line_config_error(value):
    cfg = load_config(REPO / "yamls/tiny-cpu.yaml", [f"+model.eval_timesteps={value}"])
    with pytest.raises(ConfigError, match=r"^model.eval_timesteps must be a whole number of timesteps, 2 or"):
        parse_config(cfg)
