"""Validation measures the same thing each time: the model's eval draws are seeded per sample, and
evaluating during training changes nothing about the training."""

import gc
import random

import numpy as np
import pytest
import torch
from composer.core import Callback

from extensions.callbacks import read_loss_log
from models import build_model
from recipes import build_trainer, load_config
from tests.conftest import REPO, tiny_run

BATCHES = 4


def _batch(n=4):
    generator = torch.Generator().manual_seed(3)
    return {
        "image": torch.rand(n, 3, 32, 32, generator=generator) * 2 - 1,
        "input_ids": torch.randint(1, 49406, (n, 77), generator=generator),
    }


@torch.no_grad()
def test_eval_loss_is_the_same_every_time_and_draws_nothing_from_the_global_rng():
    torch.manual_seed(0)
    model = build_model("tiny", caption_drop_prob=1.0, offset_noise=0.1).eval()
    batch = _batch()
    before = torch.get_rng_state()
    first = model.eval_forward(batch)
    assert torch.equal(torch.get_rng_state(), before)  # the global RNG was not touched
    loss = model.loss(first, batch)

    torch.rand(1000)  # training steps would have advanced the global RNG
    model.train()  # even in train mode, where training drops every caption (prob 1.0)
    again = model.eval_forward(batch)
    assert torch.equal(model.loss(again, batch), loss)
    assert all(torch.equal(a, b) for a, b in zip(first, again))

    # The draws belong to the sample, not to its batch: half the batch gets the same noise and timesteps.
    target, timesteps = first[1], first[2]
    half = model.eval_forward({k: v[:2] for k, v in batch.items()})
    assert torch.equal(half[1], target[:2]) and torch.equal(half[2], timesteps[:2])
    # ...and differ between samples, and with the eval seed.
    assert not torch.equal(target[0], target[1]) and len(set(timesteps.tolist())) > 1
    model.eval_seed = 1
    assert not torch.equal(model.eval_forward(batch)[1], target)


def test_training_forward_still_uses_the_global_rng():
    model = build_model("tiny").train()
    batch = _batch(2)
    torch.manual_seed(5)
    first = model(batch)[1]
    torch.manual_seed(5)
    assert torch.equal(model(batch)[1], first)
    assert not torch.equal(model(batch)[1], first)  # the next draws differ


class _EvalLosses(Callback):
    def __init__(self):
        self.values = []

    def eval_end(self, state, logger):
        self.values.append(state.eval_metric_values["MeanSquaredError"])


class _DrawsDuringEval(Callback):
    """Something else that runs during evaluation and draws from every global RNG (a sampling callback
    that seeds nothing, say)."""

    def eval_start(self, state, logger):
        torch.rand(7), np.random.rand(7), random.random()


def _run(shapes_mds, tmp_path, *extra, callbacks=()):
    overrides = [
        *tiny_run(shapes_mds, BATCHES),
        f"+callbacks.loss_log={{_target_: extensions.callbacks.LossLog, path: {tmp_path / 'loss.jsonl'}}}",
        *extra,
    ]
    trainer = build_trainer(load_config(REPO / "yamls/tiny-cpu.yaml", overrides))
    evals = _EvalLosses()
    trainer.state.callbacks.extend([evals, *callbacks])
    trainer.fit()
    unet = {k: v.detach().clone() for k, v in trainer.state.model.unet.state_dict().items()}
    return trainer, unet, read_loss_log(tmp_path / "loss.jsonl"), evals.values


@pytest.mark.fit
def test_periodic_evaluation_leaves_training_bitwise_unchanged(shapes_mds, tmp_path):
    trainer, unet, losses, _ = _run(shapes_mds, tmp_path / "plain")
    trainer.close()
    del trainer
    gc.collect()

    trainer, unet_eval, losses_eval, evals = _run(
        shapes_mds,
        tmp_path / "eval",
        f"+data.eval={{local: {shapes_mds / 'mds'}, resolution: 32}}",
        "trainer.eval_interval=2ba",
        "trainer.eval_subset_num_batches=1",
        callbacks=[_DrawsDuringEval()],
    )
    assert len(evals) == BATCHES // 2  # it did evaluate, after batches 2 and 4
    assert list(losses_eval) == list(range(1, BATCHES + 1))
    assert losses_eval == losses  # the same per-batch losses, exactly
    assert unet_eval.keys() == unet.keys()
    assert all(torch.equal(unet_eval[k], unet[k]) for k in unet)

    # The same checkpoint measured again, after the global RNG moved on: the same validation loss.
    torch.rand(1000)
    trainer.eval()
    assert evals[-1] == evals[-2]
    trainer.close()
