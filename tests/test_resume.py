"""A run killed with SIGKILL at a random batch and restarted with the same command (autoresume)
ends bitwise identical to an uninterrupted run: UNet, EMA and every batch's loss. On two processes
(`composer -n 2`, tests/launch.py). One process is killed the same way by tests/test_resume_s3.py
(twice, checkpoints in S3) and, during a checkpoint write, by tests/test_atomic_checkpoint.py: a
third one-process kill here took ~15 s of CPU in every `make test` for no path of its own."""

import pytest

from tests.conftest import REPO
from tests.resume_check import (
    BATCHES,
    assert_same_run,
    kill_point,
    run,
    run_and_kill_at,
    train_command,
    train_env,
)

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("nproc", [2])
def test_sigkill_and_resume_is_bitwise_identical(nproc, reference_run, shapes_mds, tmp_path):
    kill_at, delay, why = kill_point(2, BATCHES - 2)
    command = train_command(nproc, tmp_path, shapes_mds)
    run_and_kill_at(command, REPO, train_env(), tmp_path / "loss.jsonl", kill_at, delay)
    assert not (tmp_path / "unet-rank0.pt").exists()
    again = run(command, REPO, train_env())
    assert again.returncode == 0, f"{why}: " + again.stderr[-3000:]
    assert_same_run(reference_run(nproc), tmp_path, why)
