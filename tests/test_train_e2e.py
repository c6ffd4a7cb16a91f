import os
import subprocess
import sys

import pytest
import torch
from composer.utils import reproducibility

from models import build_model
from tests.conftest import REPO, TINY_TEST

pytestmark = pytest.mark.slow


def _composer(nproc: int, args: list[str], logs) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline", "HF_HUB_OFFLINE": "1"}
    cmd = [
        str(REPO / ".venv/bin/composer") if (REPO / ".venv/bin/composer").exists() else "composer",
        "-n",
        str(nproc),
        "--stdout",
        str(logs / "r{rank}.out"),
        "--stderr",
        str(logs / "r{rank}.err"),
        *args,
    ]
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)


def test_two_process_ddp_training_keeps_ranks_identical(shapes_mds, tmp_path):
    save = tmp_path / "ckpt"
    result = _composer(
        2,
        [
            "tests/dist_train.py",
            str(tmp_path),
            "yamls/tiny-cpu.yaml",
            f"data.train.local={shapes_mds / 'mds'}",
            *TINY_TEST,
            "trainer.max_duration=4ba",
            "trainer.save_interval=4ba",
            f"trainer.save_folder={save}",
            "trainer.progress_bar=false",
        ],
        tmp_path,
    )
    logs = "".join(p.read_text() for p in sorted(tmp_path.glob("r*.*")))
    assert result.returncode == 0, result.stdout + result.stderr + logs
    rank0 = torch.load(tmp_path / "unet-rank0.pt")
    rank1 = torch.load(tmp_path / "unet-rank1.pt")
    assert rank0.keys() == rank1.keys()
    assert all(torch.equal(rank0[k], rank1[k]) for k in rank0)
    # Training moved the weights away from the seeded initialisation.
    reproducibility.seed_all(17)
    initial = build_model("tiny").unet.state_dict()
    assert any(not torch.equal(rank0[k], initial[k]) for k in rank0)
    # The checkpoint holds the same trained UNet.
    checkpoint = save / "ep0-ba4-rank0.pt"
    assert checkpoint.exists(), sorted(p.name for p in save.iterdir())
    saved = torch.load(checkpoint, weights_only=False)["state"]["model"]
    assert all(torch.equal(saved[f"unet.{k}"], rank0[k]) for k in rank0)


def test_train_py_runs_one_process(shapes_mds, tmp_path):
    result = subprocess.run(
        [
            sys.executable,
            "train.py",
            "yamls/tiny-cpu.yaml",
            f"data.train.local={shapes_mds / 'mds'}",
            *TINY_TEST,
            "trainer.max_duration=2ba",
            f"trainer.save_folder={tmp_path}",
            "trainer.progress_bar=false",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert list(tmp_path.glob("*.pt"))
