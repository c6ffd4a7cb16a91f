"""The entry points train: `composer -n 2` (the shared two-process reference run) and train.py."""

import math

import pytest
import torch
from composer.utils import reproducibility

import train as train_py
from extensions.callbacks import read_loss_log
from extensions.ema import ema_weights
from models import build_model
from models.export import load_model_from_checkpoint
from tests.conftest import REPO, TINY_TEST
from tests.resume_check import BATCHES

pytestmark = pytest.mark.slow


def test_two_process_run_checkpoints_the_trained_unet_and_its_ema(reference_run):
    """Under `composer -n 2` (DDP) the last checkpoint holds the trained UNet and the EMA average,
    which lags the weights (half-life 3 batches) and has moved from the initialisation too. (That
    both ranks hold the same weights is DDP's construction; not tested here.)"""
    out = reference_run(2)
    trained = torch.load(out / "unet-rank0.pt")
    # Training moved the weights away from the seeded initialisation.
    reproducibility.seed_all(17)
    initial = build_model("tiny").unet.state_dict()
    assert trained.keys() == initial.keys()
    assert any(not torch.equal(trained[k], initial[k]) for k in trained)
    # The last checkpoint holds that same trained UNet.
    (checkpoint,) = (out / "ckpt").glob(f"ep*-ba{BATCHES}-rank0.pt")
    state = torch.load(checkpoint, weights_only=False)["state"]
    assert all(torch.equal(state["model"][f"unet.{k}"], trained[k]) for k in trained)
    ema = {k.removeprefix("unet."): v for k, v in torch.load(out / "ema-rank0.pt").items()}
    (name, saved_ema), *_ = state["algorithms"]
    assert name == "EMA" and ema.keys() == trained.keys()
    assert all(torch.equal(saved_ema["ema"][f"unet.{k}"], ema[k]) for k in ema)
    weights = [k for k in ema if trained[k].is_floating_point()]
    assert weights and all(ema[k].dtype == torch.float32 for k in weights)
    assert any(not torch.equal(ema[k], trained[k]) for k in weights)
    assert any(not torch.equal(ema[k], initial[k]) for k in weights)


def test_train_py_trains_the_run_it_is_given_and_its_checkpoint_loads_the_trained_weights(
    shapes_mds, tmp_path, monkeypatch
):
    """train.py with a recipe and overrides trains that many batches, a finite loss each, and its last
    checkpoint loads (models/export.py) into a model with the weights the run ended with, moved from
    those it started with, and the EMA average the run kept."""
    import recipes.trainer

    built = {}
    build_trainer = recipes.trainer.build_trainer

    def keep(cfg):
        built["trainer"] = trainer = build_trainer(cfg)
        built["initial"] = {k: v.clone() for k, v in trainer.state.model.unet.state_dict().items()}
        return trainer

    monkeypatch.setattr(recipes.trainer, "build_trainer", keep)
    monkeypatch.chdir(tmp_path)  # relative recipe paths (runs/...) land here
    train_py.main(
        [
            str(REPO / "yamls/tiny-cpu.yaml"),
            f"data.train.local={shapes_mds / 'mds'}",
            *TINY_TEST,
            "trainer.max_duration=3ba",
            f"trainer.save_folder={tmp_path / 'ckpt'}",
            "trainer.progress_bar=false",
            "+callbacks.loss_log={_target_: extensions.callbacks.LossLog, "
            f"path: {tmp_path / 'loss.jsonl'}}}",
        ]
    )
    trainer = built["trainer"]
    losses = read_loss_log(tmp_path / "loss.jsonl")
    assert list(losses) == [1, 2, 3] and all(math.isfinite(x) and x > 0 for x in losses.values())
    (checkpoint,) = (tmp_path / "ckpt").glob("ep*-ba3-rank0.pt")
    final = trainer.state.model.unet.state_dict()
    with ema_weights(trainer):
        average = {k: v.clone() for k, v in trainer.state.model.unet.state_dict().items()}
    raw = load_model_from_checkpoint(checkpoint, ema=False).unet.state_dict()
    assert raw.keys() == final.keys() and all(torch.equal(raw[k], final[k]) for k in final)
    assert any(not torch.equal(final[k], built["initial"][k]) for k in final)
    averaged = load_model_from_checkpoint(checkpoint, ema=True).unet.state_dict()
    assert all(torch.equal(averaged[k], average[k]) for k in average)
    assert any(not torch.equal(average[k], final[k]) for k in final if final[k].is_floating_point())
