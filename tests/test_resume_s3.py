"""Resume with save_folder on s3:// (the SeaweedFS test server): a run killed with SIGKILL twice at
random batches, restarted each time with the same command, resumes right after the newest
checkpoint in the bucket (recipes/resume.py), writes nothing in its working directory and ends
bitwise identical to an uninterrupted run. Its data are read from the bucket too, through a cache
that starts empty.

Composer 0.32 stages a remote save_folder's checkpoints in a temporary folder and uploads them
asynchronously (from threads of the run: compat.composer.upload_in_threads).
"""

import json
import os
import random
import re
import signal
import subprocess
import time

import pytest

from tests.resume_check import BATCHES, assert_same_run, run, train_command, train_env
from tests.s3_server import BUCKET, s3_server  # noqa: F401  (fixture)
from tests.test_train_from_s3 import upload_folder

pytestmark = pytest.mark.slow


def _remote_batches(server, prefix: str) -> list[int]:
    """The batch counts of the rank-0 checkpoints in the bucket under `prefix`."""
    listing = server.client().list_objects_v2(Bucket=BUCKET, Prefix=prefix)
    names = [o["Key"] for o in listing.get("Contents", [])]
    return sorted(int(m[1]) for n in names if (m := re.search(r"-ba(\d+)-rank0\.pt$", n)))


def _run_until_logged(cmd, cwd, env, loss_log, batch, delay, timeout=300) -> list[int]:
    """Run `cmd` and SIGKILL its process group `delay` seconds after it logs `batch` (this run's own
    record, not an earlier run's); the batches this run logged."""
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
                time.sleep(delay)  # inside the next batch, its save or its upload
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


def test_two_kills_each_restart_resumes_from_the_newest_checkpoint_in_the_bucket(
    s3_server,  # noqa: F811
    reference_run,
    shapes_mds,
    tmp_path,
):
    """A run reading its data from S3 through an empty cache and saving its checkpoints there,
    killed twice. Composer 0.32.1's own autoresume went back in time on the second restart (it
    preferred the `./s3:/...` copy the first restart left in the working directory) and lagged the
    bucket by the 30-40 s its `latest` pointer takes to upload. Here every restart must resume right
    after the newest checkpoint in the bucket, write nothing in its working directory, and the run
    must end with the uninterrupted run's weights. Two kills, so that a restart follows a restart
    (what went wrong); a third kill took another ~25 s of the suite and tested nothing new."""
    env = train_env(**s3_server.env())
    seed = int(os.environ.get("KILL_SEED") or random.randrange(2**32))
    rng = random.Random(seed)
    first = rng.randint(2, 4)
    kills = [first, rng.randint(first + 2, BATCHES - 1)]
    delays = [rng.uniform(0.0, 0.3) for _ in kills]  # after each kill batch is logged
    why = f"killed at batches {kills}, {[round(d, 3) for d in delays]} s after; repeat with KILL_SEED={seed}"
    prefix = f"resume3-{tmp_path.name}/ckpt"
    workdir = tmp_path / "cwd"
    workdir.mkdir()
    loss_log = tmp_path / "loss.jsonl"

    # The data too are read from the bucket, through a cache that starts empty, as on a fresh node.
    data = upload_folder(s3_server, shapes_mds / "mds", f"resume3-{tmp_path.name}/data")
    remote_data = [f"data.train.remote={data}", f"data.train.local={tmp_path / 'cache'}"]

    def command(await_batch: int | None):
        probe = f"{{_target_: tests.probes.AwaitRemoteCheckpoint, batch: {await_batch}}}"
        probes = [f"+callbacks.await_ckpt={probe}"] if await_batch else []
        save_folder = f"s3://{BUCKET}/{prefix}"
        return train_command(1, tmp_path, shapes_mds, *remote_data, *probes, save_folder=save_folder)

    for i, kill_at in enumerate([*kills, None]):
        in_bucket = _remote_batches(s3_server, prefix)
        expected_start = (max(in_bucket) if in_bucket else 0) + 1
        if kill_at is None:
            before = loss_log.read_text().count("\n")
            result = run(command(None), workdir, env)
            assert result.returncode == 0, f"{why}: " + result.stderr[-3000:]
            logged = [json.loads(line)["batch"] for line in loss_log.read_text().splitlines()[before:]]
        else:
            logged = _run_until_logged(command(kill_at), workdir, env, loss_log, kill_at, delays[i])
        where = f"run {i + 1}: resumed at {logged[0]}, the bucket held {in_bucket}; {why}"
        assert logged[0] == expected_start, where

    written = list(workdir.iterdir())
    assert written == [], f"written outside the configured folders: {written}"
    assert _remote_batches(s3_server, prefix)[-1] == BATCHES
    # Composer's `latest` pointer in the bucket names the final checkpoint once the run has ended.
    client = s3_server.client()
    keys = [o["Key"] for o in client.list_objects_v2(Bucket=BUCKET, Prefix=prefix)["Contents"]]
    pointer = next(k for k in keys if k.endswith("latest-rank0.pt.symlink"))
    target = client.get_object(Bucket=BUCKET, Key=pointer)["Body"].read().decode()
    assert target.endswith(f"-ba{BATCHES}-rank0.pt"), target
    assert_same_run(reference_run(1), tmp_path, why)
