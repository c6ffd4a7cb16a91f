"""Sharded checkpoints in object storage (the SeaweedFS test server): `composer -n 2 ...
parallelism.shard=2` saving to s3://, SIGKILLed at a random moment after a checkpoint is in the
bucket, rerun with the same command in an empty working directory: it resumes right after the newest
complete checkpoint in the bucket (every rank's file and the metadata: recipes/remote_sharded.py),
writes nothing locally, and ends bitwise equal to the uninterrupted run (tests/conftest.py
mmdit_reference)."""

import os
import random
import re

import pytest

from extensions.callbacks import read_loss_log
from tests.fsdp2_runs import BATCHES, mmdit_command
from tests.resume_check import assert_same_run, run, run_and_kill_at, train_env
from tests.s3_server import BUCKET, s3_server  # noqa: F401  (fixture)

pytestmark = pytest.mark.slow


def _complete_batches(server, prefix: str) -> list[int]:
    """The batches whose sharded checkpoint is whole in the bucket (metadata and both ranks' files)."""
    listing = server.client().list_objects_v2(Bucket=BUCKET, Prefix=prefix)
    files: dict[int, set[str]] = {}
    for obj in listing.get("Contents", []):
        if match := re.match(rf"{re.escape(prefix)}/ep\d+-ba(\d+)/([^/]+)$", obj["Key"]):
            files.setdefault(int(match[1]), set()).add(match[2])
    return sorted(b for b, names in files.items() if {".metadata", "__0_0.distcp", "__1_0.distcp"} <= names)


def test_killed_sharded_run_resumes_from_the_bucket(s3_server, mmdit_reference, shapes_mds, tmp_path):  # noqa: F811
    env = train_env(**s3_server.env())
    seed = int(os.environ.get("KILL_SEED") or random.randrange(2**32))
    draw = random.Random(seed)
    kill_at, delay = draw.randint(2, BATCHES - 2), draw.uniform(0.0, 0.3)
    why = f"killed {delay:.3f} s after batch {kill_at}; repeat with KILL_SEED={seed}"
    prefix = f"fsdp2-{tmp_path.name}/ckpt"
    save_folder = f"s3://{BUCKET}/{prefix}"
    workdir = tmp_path / "cwd"
    workdir.mkdir()
    # Held before batch kill_at until the checkpoint of the batch before is whole in the bucket.
    probe = f"+callbacks.await_ckpt={{_target_: tests.probes.AwaitRemoteCheckpoint, batch: {kill_at}}}"
    first = mmdit_command("shard-2", tmp_path, shapes_mds, probe, save_folder=save_folder)
    run_and_kill_at(first, workdir, env, tmp_path / "loss.jsonl", kill_at, delay)
    in_bucket = _complete_batches(s3_server, prefix)
    assert in_bucket and max(in_bucket) >= kill_at - 1, f"{in_bucket}; {why}"

    logged = len(read_loss_log(tmp_path / "loss.jsonl"))
    lines = (tmp_path / "loss.jsonl").read_text().count("\n")
    again = run(mmdit_command("shard-2", tmp_path, shapes_mds, save_folder=save_folder), workdir, env)
    assert again.returncode == 0, f"{why}: " + again.stderr[-3000:]
    resumed = (tmp_path / "loss.jsonl").read_text().splitlines()[lines]
    assert f'"batch": {max(in_bucket) + 1},' in resumed, f"{resumed}, the bucket held {in_bucket}; {why}"
    assert logged >= kill_at
    assert list(workdir.iterdir()) == [], "written outside the configured folders"
    assert _complete_batches(s3_server, prefix)[-1] == BATCHES
    assert_same_run(mmdit_reference("shard-2"), tmp_path, why, BATCHES)
