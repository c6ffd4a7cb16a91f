"""Checkpoint files are written atomically: a save that dies halfway leaves no torn checkpoint, and
autoresume continues from the previous good one."""

import os
import random
import signal
import sys

import pytest
import torch
from composer.utils import checkpoint

from recipes.callbacks import read_loss_log
from recipes.checkpointing import install_atomic_checkpoint_writes
from tests.conftest import REPO
from tests.resume_check import run

BATCHES = 6


class ExplodesWhenPickled:
    def __reduce__(self):
        raise OSError("disk vanished")  # after torch.save has written the tensors before it


@pytest.fixture
def atomic_writes(monkeypatch):
    monkeypatch.setattr(checkpoint, "_write_checkpoint_file", checkpoint._write_checkpoint_file)  # undo after
    install_atomic_checkpoint_writes()
    return checkpoint._write_checkpoint_file


def test_failed_write_keeps_the_previous_file_and_leaves_no_partial_one(atomic_writes, tmp_path):
    target = tmp_path / "ep0-ba4-rank0.pt"
    atomic_writes({"weights": torch.arange(10.0)}, str(target))
    before = target.read_bytes()
    # A save that overwrites the same name (a resumed run re-saving a batch) and fails halfway.
    with pytest.raises(OSError, match="disk vanished"):
        atomic_writes({"weights": torch.zeros(100_000), "bad": ExplodesWhenPickled()}, str(target))
    assert target.read_bytes() == before
    assert torch.equal(torch.load(target)["weights"], torch.arange(10.0))
    with pytest.raises(OSError):
        atomic_writes(
            {"weights": torch.zeros(100_000), "bad": ExplodesWhenPickled()}, str(tmp_path / "new.pt")
        )
    assert sorted(p.name for p in tmp_path.iterdir()) == [target.name]  # no new.pt, no temporary file


def test_install_is_idempotent(atomic_writes):
    install_atomic_checkpoint_writes()
    assert checkpoint._write_checkpoint_file is atomic_writes


def _command(out, shapes_mds, *extra) -> list[str]:
    return [
        sys.executable,
        "tests/dist_train.py",
        str(out),
        "yamls/tiny-cpu.yaml",
        f"data.train.local={shapes_mds / 'mds'}",
        "~data.train.prepare",
        "model.pretrained=null",
        "global_train_batch_size=16",
        f"trainer.max_duration={BATCHES}ba",
        "trainer.save_interval=1ba",
        "trainer.save_num_checkpoints_to_keep=-1",
        "trainer.autoresume=true",
        "trainer.save_overwrite=false",  # a torn file left under the final name would then block the rerun
        f"trainer.save_folder={out / 'ckpt'}",
        "trainer.progress_bar=false",
        f"+callbacks.loss_log={{_target_: recipes.callbacks.LossLog, path: {out / 'loss.jsonl'}}}",
        *extra,
    ]


@pytest.mark.slow
def test_sigkill_halfway_through_a_save_then_autoresume(shapes_mds, tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline", "PYTHONPATH": str(REPO)}
    kill_at = random.Random().randint(2, BATCHES - 2)  # chosen afresh each run
    killed = run(
        _command(
            tmp_path,
            shapes_mds,
            f"+callbacks.kill={{_target_: tests.probes.KillDuringSave, batch: {kill_at}}}",
        ),
        REPO,
        env,
    )
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]

    ckpt = tmp_path / "ckpt"
    names = sorted(p.name for p in ckpt.iterdir())
    # The torn half-file exists only under a temporary name that nothing loads.
    torn = [n for n in names if n.startswith(".tmp-") and n.endswith(f"-ba{kill_at}-rank0.pt")]
    assert len(torn) == 1, names
    assert not any(n.endswith(f"-ba{kill_at}-rank0.pt") and not n.startswith(".tmp-") for n in names), names
    latest = (ckpt / "latest-rank0.pt").resolve()
    assert latest.name.endswith(f"-ba{kill_at - 1}-rank0.pt")
    for path in ckpt.glob("ep*-ba*-rank0.pt"):  # every checkpoint that can be loaded by name loads
        assert torch.load(path, weights_only=False)["state"]["timestamp"]["Timestamp"]["batch"] >= 1

    resumed = run(_command(tmp_path, shapes_mds), REPO, env)
    assert resumed.returncode == 0, f"killed in the save of batch {kill_at}: " + resumed.stderr[-3000:]
    lines = (tmp_path / "loss.jsonl").read_text().splitlines()
    assert len(lines) == BATCHES + 1  # batch kill_at was trained twice: its checkpoint never completed
    assert sorted(read_loss_log(tmp_path / "loss.jsonl")) == list(range(1, BATCHES + 1))
    final = torch.load(ckpt / f"ep1-ba{BATCHES}-rank0.pt", weights_only=False)["state"]
    assert final["timestamp"]["Timestamp"]["batch"] == BATCHES
