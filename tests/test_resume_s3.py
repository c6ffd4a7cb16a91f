"""Deterministic resume with save_folder on s3:// (the SeaweedFS test server): a run killed with
SIGKILL at a random batch and restarted with the same command resumes from the bucket and ends
bitwise identical to an uninterrupted run.

Composer 0.32 stages a remote save_folder's checkpoints in a temporary folder and uploads them (and
a `latest-rank0.pt.symlink` object naming the newest) asynchronously; on restart, autoresume
downloads the checkpoint that object names to `./s3:/BUCKET/PREFIX/latest-rank0.pt` under the
working directory, which is why the runs here start in tmp_path.
"""

import pytest

from tests.resume_check import (
    BATCHES,
    assert_same_run,
    kill_point,
    run,
    run_and_kill_at,
    train_command,
    train_env,
)
from tests.s3_server import BUCKET, s3_server  # noqa: F401  (fixture)

pytestmark = pytest.mark.slow


def _restart_batch(loss_log) -> int:
    """The first batch the restarted run trained (its records follow the killed run's)."""
    batches = [int(line.split(":")[1].split(",")[0]) for line in loss_log.read_text().splitlines()]
    return next(b for prev, b in zip(batches, batches[1:]) if b <= prev)


def test_sigkill_and_resume_from_s3_is_bitwise_identical(s3_server, reference_run, shapes_mds, tmp_path):  # noqa: F811
    # Where checkpoints go does not change training: the shared reference saved to a local folder.
    env = train_env(**s3_server.env())
    kill_at, why = kill_point(2, BATCHES - 3)
    save_folder = f"s3://{BUCKET}/resume-{tmp_path.name}/ckpt"
    probes = [
        "+callbacks.fast_symlinks={_target_: tests.probes.FastRemoteSymlinks}",
        f"+callbacks.await_remote={{_target_: tests.probes.AwaitRemoteLatest, batch: {kill_at}}}",
    ]
    command = train_command(1, tmp_path, shapes_mds, *probes, save_folder=save_folder)
    run_and_kill_at(command, tmp_path, env, tmp_path / "loss.jsonl", kill_at)
    assert not (tmp_path / "unet-rank0.pt").exists()
    again = run(command, tmp_path, env)  # the same command; await_remote finds the bucket ready at once
    assert again.returncode == 0, f"{why}: " + again.stderr[-3000:]

    # It resumed from the bucket (not from scratch): from the checkpoint of batch kill_at - 1 or later.
    assert _restart_batch(tmp_path / "loss.jsonl") >= kill_at, why
    keys = [o["Key"] for o in s3_server.client().list_objects_v2(Bucket=BUCKET)["Contents"]]
    assert any(
        k.startswith(f"resume-{tmp_path.name}/ckpt/") and k.endswith(f"-ba{BATCHES}-rank0.pt") for k in keys
    )
    assert_same_run(reference_run(1), tmp_path, why)
