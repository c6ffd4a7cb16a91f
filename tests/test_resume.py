"""A run killed with SIGKILL at a random batch and restarted with the same command (autoresume)
ends bitwise identical to an uninterrupted run: UNet, EMA and every batch's loss."""

import os
import random
import sys

import pytest
import torch

from recipes.callbacks import read_loss_log
from tests.conftest import REPO, TINY_TEST
from tests.resume_check import run, run_and_kill_at

pytestmark = pytest.mark.slow
BATCHES = 10  # 64 samples / 16 per batch = 4 batches per epoch: resumes land mid- and across epochs


def _command(nproc: int, out, shapes_mds) -> list[str]:
    # dist_train.py is train.py plus saving each rank's final UNet and EMA weights for comparison.
    launcher = [sys.executable] if nproc == 1 else [str(REPO / ".venv/bin/composer"), "-n", str(nproc)]
    launcher += ["tests/dist_train.py", str(out)]
    return [
        *launcher,
        "yamls/tiny-cpu.yaml",
        f"data.train.local={shapes_mds / 'mds'}",
        "~data.train.prepare",
        *TINY_TEST,
        f"trainer.max_duration={BATCHES}ba",
        "trainer.save_interval=1ba",
        "trainer.autoresume=true",
        "trainer.save_overwrite=true",
        f"trainer.save_folder={out / 'ckpt'}",
        "trainer.progress_bar=false",
        "algorithms.ema.half_life=3",
        f"+callbacks.loss_log={{_target_: recipes.callbacks.LossLog, path: {out / 'loss.jsonl'}}}",
    ]


@pytest.mark.parametrize("nproc", [1, 2])
def test_sigkill_and_resume_is_bitwise_identical(nproc, shapes_mds, tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline"}
    reference, resumed = tmp_path / "reference", tmp_path / "resumed"
    for out in (reference, resumed):
        out.mkdir()

    done = run(_command(nproc, reference, shapes_mds), REPO, env)
    assert done.returncode == 0, done.stderr[-3000:]

    kill_at = random.Random().randint(2, BATCHES - 2)  # chosen afresh each run
    run_and_kill_at(_command(nproc, resumed, shapes_mds), REPO, env, resumed / "loss.jsonl", kill_at)
    assert not (resumed / "unet-rank0.pt").exists()
    again = run(_command(nproc, resumed, shapes_mds), REPO, env)
    assert again.returncode == 0, f"killed at batch {kill_at}: " + again.stderr[-3000:]

    assert read_loss_log(resumed / "loss.jsonl") == read_loss_log(reference / "loss.jsonl")
    assert len(read_loss_log(reference / "loss.jsonl")) == BATCHES
    for name in ("unet-rank0.pt", "ema-rank0.pt"):
        want, got = torch.load(reference / name), torch.load(resumed / name)
        assert want.keys() == got.keys()
        assert all(torch.equal(want[k], got[k]) for k in want), f"{name} differs (killed at {kill_at})"
