"""The EMA algorithm inside real Composer runs of the tiny recipe."""

import pytest
import torch
from composer.core import Callback

from extensions.ema import find_ema
from recipes import build_trainer, load_config
from tests.conftest import REPO, TINY_TEST

EMA_OVERRIDES = ["algorithms.ema._target_=extensions.ema.EMA", "algorithms.ema.half_life=2"]


def _overrides(shapes_mds, tmp_path, *extra):
    return [
        f"data.train.local={shapes_mds / 'mds'}",
        "~data.train.prepare",
        *TINY_TEST,
        f"trainer.save_folder={tmp_path / 'ckpt'}",
        "trainer.progress_bar=false",
        *EMA_OVERRIDES,
        *extra,
    ]


class _Record(Callback):
    """Copies the UNet weights at the events the test cares about."""

    def __init__(self):
        self.seen = {}

    def batch_end(self, state, logger):
        self.seen["batch_end"] = _unet_of(state)

    def eval_start(self, state, logger):
        self.seen["eval_start"] = _unet_of(state)

    def eval_end(self, state, logger):
        self.seen["eval_end"] = _unet_of(state)

    def batch_start(self, state, logger):
        ema = find_ema(state.algorithms)
        self.seen.setdefault("ema_at_first_batch", {k: v.clone() for k, v in ema.averaged_state().items()})


def _unet_of(state):
    model = getattr(state.model, "module", state.model)
    return {k: v.detach().clone() for k, v in model.unet.named_parameters()}


@pytest.mark.fit
def test_eval_sees_ema_weights_and_training_keeps_raw(shapes_mds, tmp_path):
    record = _Record()
    cfg = load_config(
        REPO / "yamls/tiny-cpu.yaml",
        _overrides(
            shapes_mds,
            tmp_path,
            "trainer.max_duration=3ba",
            "trainer.eval_interval=3ba",
            f"+data.eval={{local: {shapes_mds / 'mds'}, resolution: 32}}",
        ),
    )
    trainer = build_trainer(cfg)
    trainer.state.callbacks.append(record)
    trainer.fit()
    ema = find_ema(trainer.state.algorithms)
    averaged = {k.removeprefix("unet."): v for k, v in ema.averaged_state().items() if k.startswith("unet.")}
    assert len(averaged) == len(record.seen["eval_start"])
    assert all(torch.equal(record.seen["eval_start"][k], averaged[k]) for k in averaged)
    raw = record.seen["batch_end"]
    assert all(torch.equal(record.seen["eval_end"][k], raw[k]) for k in raw)
    assert any(not torch.equal(raw[k], averaged[k]) for k in raw)
    # Only the UNet is tracked: the frozen VAE and text encoder are never copied.
    assert all(k.startswith("unet.") for k in ema.averaged_state())


@pytest.mark.fit
def test_checkpoint_restores_ema_exactly(shapes_mds, tmp_path):
    first = build_trainer(
        load_config(
            REPO / "yamls/tiny-cpu.yaml", _overrides(shapes_mds, tmp_path, "trainer.max_duration=3ba")
        )
    )
    first.fit()
    saved = find_ema(first.state.algorithms).averaged_state()
    checkpoint = first.saved_checkpoints[-1]
    record = _Record()
    second = build_trainer(
        load_config(
            REPO / "yamls/tiny-cpu.yaml",
            _overrides(
                shapes_mds,
                tmp_path / "second",
                "trainer.max_duration=4ba",
                f"+trainer.load_path={checkpoint}",
            ),
        )
    )
    second.state.callbacks.append(record)
    second.fit()
    restored = record.seen["ema_at_first_batch"]
    assert restored.keys() == saved.keys()
    assert all(torch.equal(restored[k], saved[k]) for k in saved)
    assert find_ema(second.state.algorithms).start_batch == 0
