"""Checkpoint files are written atomically: a save that dies halfway leaves no torn checkpoint, and
autoresume continues from the previous good one."""

import signal

import pytest
import torch

from compat.composer import checkpoint_file_writer, set_checkpoint_file_writer
from extensions.checkpointing import install_atomic_checkpoint_writes
from tests.conftest import REPO
from tests.resume_check import BATCHES, assert_same_run, kill_point, run, train_command, train_env


class ExplodesWhenPickled:
    def __reduce__(self):
        raise OSError("disk vanished")  # after torch.save has written the tensors before it


@pytest.fixture
def atomic_writes():
    original = checkpoint_file_writer()
    install_atomic_checkpoint_writes()
    yield checkpoint_file_writer()
    set_checkpoint_file_writer(original)  # undo after


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
    assert checkpoint_file_writer() is atomic_writes


@pytest.mark.slow
def test_sigkill_halfway_through_a_save_then_autoresume(reference_run, shapes_mds, tmp_path):
    kill_at, _, why = kill_point(2, BATCHES - 2)
    # save_overwrite=false: a torn file left under the final name would then block the rerun.
    command = train_command(1, tmp_path, shapes_mds, "trainer.save_overwrite=false")
    killed = run(
        [*command, f"+callbacks.kill={{_target_: tests.probes.KillDuringSave, batch: {kill_at}}}"],
        REPO,
        train_env(),
    )
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]

    ckpt = tmp_path / "ckpt"
    names = sorted(p.name for p in ckpt.iterdir())
    # The torn half-file exists only under a temporary name that nothing loads.
    torn = [n for n in names if n.startswith(".tmp-") and n.endswith(f"-ba{kill_at}-rank0.pt")]
    assert len(torn) == 1, f"{why}: {names}"
    assert not any(n.endswith(f"-ba{kill_at}-rank0.pt") and not n.startswith(".tmp-") for n in names), names
    latest = (ckpt / "latest-rank0.pt").resolve()
    assert latest.name.endswith(f"-ba{kill_at - 1}-rank0.pt"), why
    for path in ckpt.glob("ep*-ba*-rank0.pt"):  # every checkpoint that can be loaded by name loads
        assert torch.load(path, weights_only=False)["state"]["timestamp"]["Timestamp"]["batch"] >= 1

    resumed = run(command, REPO, train_env())
    assert resumed.returncode == 0, f"{why}: " + resumed.stderr[-3000:]
    lines = (tmp_path / "loss.jsonl").read_text().splitlines()
    assert len(lines) == BATCHES + 1, why  # batch kill_at was trained twice: its checkpoint never completed
    # ... and the run still ends exactly where an uninterrupted one does.
    assert_same_run(reference_run(1), tmp_path, why)
