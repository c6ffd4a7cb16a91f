"""The entry points train: `composer -n 2` (the shared two-process reference run) and train.py."""

import pytest
import torch
from composer.utils import reproducibility

import train as train_py
from models import build_model
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


def test_train_py_runs_one_process(shapes_mds, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # relative recipe paths (runs/...) land here
    train_py.main(
        [
            str(REPO / "yamls/tiny-cpu.yaml"),
            f"data.train.local={shapes_mds / 'mds'}",
            *TINY_TEST,
            "trainer.max_duration=2ba",
            f"trainer.save_folder={tmp_path / 'ckpt'}",
            "trainer.progress_bar=false",
        ]
    )
    assert list((tmp_path / "ckpt").glob("ep*-ba2-rank0.pt"))
