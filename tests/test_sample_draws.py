"""Training draws keyed per sample (`model.train_draws: sample`, models/engine/draw_keys.py): a batch's loss
does not depend on how it is split into microbatches or processes, nor on its order; the draws follow
the run's seed, the batch index and each sample's index; caption dropout is drawn per sample too; the
data loader hands the indices over as host ints. The multi-process runs: tests/test_fsdp2_train.py."""

import pytest
import torch

from data.loader import collate
from models import build_model
from models.engine.draw_keys import SAMPLE_INDEX, draw_seeds

CAPTIONS = ["a red circle", "a blue square", "a green triangle", "a red square"] * 2


def _batch(model, indices, seed=0):
    torch.manual_seed(seed)
    n = len(indices)
    batch = {"image": torch.rand(n, 3, 32, 32) * 2 - 1, **model.conditioner.ids(model, CAPTIONS[:n])}
    batch[SAMPLE_INDEX] = list(indices)
    return batch


def _rows(batch, rows):
    return {k: [v[i] for i in rows] if isinstance(v, list) else v[rows] for k, v in batch.items()}


def _loss(model, batch) -> torch.Tensor:
    with torch.no_grad():
        return model.loss(model(batch), batch)


@pytest.fixture(scope="module", params=["tiny", "mmdit-tiny"])  # a DDPM family and a flow family
def model(request):
    torch.manual_seed(0)
    model = build_model(request.param, caption_drop_prob=0.5, train_draws="sample").train()
    model.draw_key = (17, 3)
    return model


@pytest.mark.heavy
def test_a_batchs_loss_is_the_same_split_permuted_or_on_another_process(model):
    batch = _batch(model, [40, 7, 12, 3, 99, 5, 61, 8])
    whole = _loss(model, batch)
    halves = [_loss(model, _rows(batch, list(rows))) for rows in (range(0, 4), range(4, 8))]
    assert float(whole) == pytest.approx(float(sum(halves) / 2), rel=1e-6)
    order = [5, 2, 7, 0, 3, 6, 1, 4]
    assert float(_loss(model, _rows(batch, order))) == pytest.approx(float(whole), rel=1e-6)

    torch.manual_seed(1234)  # the global RNG (another rank's seed) plays no part
    assert torch.equal(_loss(model, batch), whole)
    model.draw_key = (17, 4)  # the next batch: other draws for the same samples
    try:
        assert float(_loss(model, batch)) != pytest.approx(float(whole), rel=1e-3)
    finally:
        model.draw_key = (17, 3)


def test_caption_dropout_is_drawn_per_sample(model):
    """The dropped captions are those whose key's uniform falls under caption_drop_prob: each such
    sample's condition is the empty caption's, the others' their own, in any batch arrangement."""
    batch = _batch(model, [40, 7, 12, 3, 99, 5, 61, 8])
    _, uniforms = draw_seeds(17, 3, batch[SAMPLE_INDEX])
    dropped = torch.tensor(uniforms) < model.caption_drop_prob
    assert 0 < int(dropped.sum()) < len(uniforms)  # this key drops some and keeps some
    seen = {}

    def record(module, args, kwargs):
        seen["context"] = kwargs["encoder_hidden_states"].detach().clone()

    hook = model.denoiser.register_forward_pre_hook(record, with_kwargs=True)
    try:
        _loss(model, batch)
    finally:
        hook.remove()
    with torch.no_grad():
        own = model.condition(batch, False, (32, 32))["encoder_hidden_states"]  # no dropout asked
    for i, drop in enumerate(dropped.tolist()):
        if drop:
            assert not torch.allclose(seen["context"][i], own[i])
        else:
            torch.testing.assert_close(seen["context"][i], own[i])


def test_the_batch_index_and_sample_indices_are_needed(model):
    batch = _batch(model, [1, 2])
    del batch[SAMPLE_INDEX]
    with pytest.raises(ValueError, match="sample_index"):
        _loss(model, batch)
    key, model.draw_key = model.draw_key, None
    try:
        with pytest.raises(RuntimeError, match="SampleDraws"):
            _loss(model, _batch(model, [1, 2]))
    finally:
        model.draw_key = key


def test_rank_draws_stay_the_default_and_bad_modes_are_refused():
    assert build_model("tiny").train_draws == "rank"
    with pytest.raises(ValueError, match="train_draws='everywhere'; choose one of"):
        build_model("tiny", train_draws="everywhere")


def test_the_loader_hands_the_indices_over_as_host_ints():
    samples = [{"latents": torch.zeros(2), SAMPLE_INDEX: i} for i in (4, 9, 2)]
    batch = collate(samples)
    assert batch[SAMPLE_INDEX] == [4, 9, 2]
    assert batch["latents"].shape == (3, 2)
    assert collate([{"latents": torch.zeros(2)}]).keys() == {"latents"}


def test_draw_seeds_are_a_function_of_seed_batch_and_index():
    a = draw_seeds(0, 0, [0, 1, 2])
    assert a == draw_seeds(0, 0, [0, 1, 2])
    assert draw_seeds(0, 0, [2, 0, 1])[0] == [a[0][2], a[0][0], a[0][1]]
    assert len(set(a[0] + draw_seeds(1, 0, [0, 1, 2])[0] + draw_seeds(0, 1, [0, 1, 2])[0])) == 9
    assert all(0 <= u < 1 for u in a[1]) and all(0 <= s < 2**63 for s in a[0])


@pytest.mark.parametrize("preset", ["tiny", "mmdit-tiny"])
def test_the_draw_cost_bench_prices_both_ways(preset, capsys):
    from bench.draw_cost import main

    main(["--preset", preset, "--resolution", "32", "--batch", "4", "--iters", "2", "--repeat", "1"])
    line = capsys.readouterr().out
    assert f"{preset} at 32 px, 4 x 4x8x8 latents on cpu" in line and "us a sample" in line, line
