"""Deterministic resume with save_folder on s3:// (the SeaweedFS test server): a run killed with
SIGKILL at a random batch and restarted with the same command resumes from the bucket and ends
bitwise identical to an uninterrupted run.

Composer 0.32 stages a remote save_folder's checkpoints in a temporary folder and uploads them (and
a `latest-rank0.pt.symlink` object naming the newest) asynchronously; on restart, autoresume
downloads the checkpoint that object names to `./s3:/BUCKET/PREFIX/latest-rank0.pt` under the
working directory, which is why the runs here start in tmp_path.
"""

import json
import os
import random
import re
import signal
import subprocess
import time

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


def _remote_batches(server, prefix: str) -> list[int]:
    """The batch counts of the rank-0 checkpoints in the bucket under `prefix`."""
    listing = server.client().list_objects_v2(Bucket=BUCKET, Prefix=prefix)
    names = [o["Key"] for o in listing.get("Contents", [])]
    return sorted(int(m[1]) for n in names if (m := re.search(r"-ba(\d+)-rank0\.pt$", n)))


def _run_until_logged(cmd, cwd, env, loss_log, batch, timeout=300) -> list[int]:
    """Run `cmd` and SIGKILL its process group at a random moment after it logs `batch` (this run's
    own record, not an earlier run's); the batches this run logged."""
    start = loss_log.stat().st_size if loss_log.exists() else 0
    stderr = loss_log.with_name(f"stderr-{batch}.txt")
    with stderr.open("w") as err:
        proc = subprocess.Popen(
            cmd, cwd=cwd, env=env, stdout=subprocess.DEVNULL, stderr=err, start_new_session=True
        )
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            new = loss_log.read_bytes()[start:].decode() if loss_log.exists() else ""
            logged = [json.loads(line)["batch"] for line in new.splitlines() if line.endswith("}")]
            if batch in logged:
                time.sleep(random.uniform(0.0, 0.3))  # inside the next batch, its save or its upload
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=30)
                new = loss_log.read_bytes()[start:].decode()
                return [json.loads(line)["batch"] for line in new.splitlines() if line.endswith("}")]
            if proc.poll() is not None:
                raise AssertionError(f"training exited ({proc.returncode}): " + stderr.read_text()[-3000:])
            time.sleep(0.02)
        raise AssertionError(f"batch {batch} not logged in {timeout} s")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


def test_three_kills_each_restart_resumes_from_the_newest_checkpoint_in_the_bucket(
    s3_server,  # noqa: F811
    reference_run,
    shapes_mds,
    tmp_path,
):
    """Composer 0.32.1's own autoresume went back in time on the second restart (it preferred the
    `./s3:/...` copy the first restart left in the working directory) and lagged the bucket by the
    30-40 s its `latest` pointer takes to upload. Here every restart must resume right after the
    newest checkpoint in the bucket, write nothing in its working directory, and the run must end
    with the uninterrupted run's weights."""
    env = train_env(**s3_server.env())
    seed = int(os.environ.get("KILL_SEED") or random.randrange(2**32))
    rng = random.Random(seed)
    first = rng.randint(2, 3)
    kills = [first, rng.randint(first + 2, 5), rng.randint(6, BATCHES - 1)]
    why = f"killed at batches {kills}; repeat with KILL_SEED={seed}"
    prefix = f"resume3-{tmp_path.name}/ckpt"
    workdir = tmp_path / "cwd"
    workdir.mkdir()
    loss_log = tmp_path / "loss.jsonl"

    def command(await_batch: int | None):
        probe = [
            f"+callbacks.await_ckpt={{_target_: tests.probes.AwaitRemoteCheckpoint, batch: {await_batch}}}"
        ]
        return train_command(1, tmp_path, shapes_mds, *(probe if await_batch else []),
                             save_folder=f"s3://{BUCKET}/{prefix}")  # fmt: skip

    for i, kill_at in enumerate([*kills, None]):
        in_bucket = _remote_batches(s3_server, prefix)
        expected_start = (max(in_bucket) if in_bucket else 0) + 1
        if kill_at is None:
            before = loss_log.read_text().count("\n")
            result = run(command(None), workdir, env)
            assert result.returncode == 0, f"{why}: " + result.stderr[-3000:]
            logged = [json.loads(line)["batch"] for line in loss_log.read_text().splitlines()[before:]]
        else:
            logged = _run_until_logged(command(kill_at), workdir, env, loss_log, kill_at)
        assert logged[0] == expected_start, (
            f"restart {i}: resumed at {logged[0]}, bucket held {in_bucket}; {why}"
        )

    assert list(workdir.iterdir()) == [], f"written outside the configured folders: {list(workdir.iterdir())}"
    assert _remote_batches(s3_server, prefix)[-1] == BATCHES
    assert_same_run(reference_run(1), tmp_path, why)
