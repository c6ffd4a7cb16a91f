"""Deterministic resume with save_folder on s3:// (the SeaweedFS test server): a run killed with
SIGKILL at a random batch and restarted with the same command resumes from the bucket and ends
bitwise identical to an uninterrupted run.

Composer 0.32 stages a remote save_folder's checkpoints in a temporary folder and uploads them (and
a `latest-rank0.pt.symlink` object naming the newest) asynchronously; on restart, autoresume
downloads the checkpoint that object names to `./s3:/BUCKET/PREFIX/latest-rank0.pt` under the
working directory, which is why the runs here start in tmp_path.
"""

import random
import sys

import pytest
import torch

from recipes.callbacks import read_loss_log
from tests.conftest import REPO, TINY_TEST
from tests.resume_check import run, run_and_kill_at
from tests.s3_server import BUCKET, s3_server  # noqa: F401  (fixture)

pytestmark = pytest.mark.slow
BATCHES = 8


def _command(out, save_folder: str, shapes_mds, *extra) -> list[str]:
    return [
        sys.executable,
        str(REPO / "tests/dist_train.py"),
        str(out),
        str(REPO / "yamls/tiny-cpu.yaml"),
        *TINY_TEST,
        f"data.train.local={shapes_mds / 'mds'}",
        "~data.train.prepare",
        f"trainer.max_duration={BATCHES}ba",
        "trainer.save_interval=1ba",
        "trainer.autoresume=true",
        "trainer.save_overwrite=true",
        f"trainer.save_folder={save_folder}",
        "trainer.progress_bar=false",
        "algorithms.ema.half_life=3",
        f"+callbacks.loss_log={{_target_: recipes.callbacks.LossLog, path: {out / 'loss.jsonl'}}}",
        *extra,
    ]


def _restart_batch(loss_log) -> int:
    """The first batch the restarted run trained (its records follow the killed run's)."""
    batches = [int(line.split(":")[1].split(",")[0]) for line in loss_log.read_text().splitlines()]
    return next(b for prev, b in zip(batches, batches[1:]) if b <= prev)


def test_sigkill_and_resume_from_s3_is_bitwise_identical(s3_server, shapes_mds, tmp_path):  # noqa: F811
    env = {**s3_server.env(), "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline", "PYTHONPATH": str(REPO)}
    reference, resumed = tmp_path / "reference", tmp_path / "resumed"
    for out in (reference, resumed):
        out.mkdir()
    # Where checkpoints go does not change training; a local folder keeps the reference quick.
    done = run(_command(reference, str(reference / "ckpt"), shapes_mds), reference, env)
    assert done.returncode == 0, done.stderr[-3000:]

    kill_at = random.Random().randint(2, BATCHES - 3)  # chosen afresh each run
    save_folder = f"s3://{BUCKET}/resume-{kill_at}/ckpt"
    probes = [
        "+callbacks.fast_symlinks={_target_: tests.probes.FastRemoteSymlinks}",
        f"+callbacks.await_remote={{_target_: tests.probes.AwaitRemoteLatest, batch: {kill_at}}}",
    ]
    command = _command(resumed, save_folder, shapes_mds, *probes)
    run_and_kill_at(command, resumed, env, resumed / "loss.jsonl", kill_at)
    assert not (resumed / "unet-rank0.pt").exists()
    again = run(command, resumed, env)  # the same command; await_remote finds the bucket ready at once
    assert again.returncode == 0, f"killed at batch {kill_at}: " + again.stderr[-3000:]

    # It resumed from the bucket (not from scratch): from the checkpoint of batch kill_at - 1 or later.
    assert _restart_batch(resumed / "loss.jsonl") >= kill_at
    keys = [o["Key"] for o in s3_server.client().list_objects_v2(Bucket=BUCKET)["Contents"]]
    assert f"resume-{kill_at}/ckpt/ep1-ba{BATCHES}-rank0.pt" in keys
    assert read_loss_log(resumed / "loss.jsonl") == read_loss_log(reference / "loss.jsonl")
    for name in ("unet-rank0.pt", "ema-rank0.pt"):
        want, got = torch.load(reference / name), torch.load(resumed / name)
        assert want.keys() == got.keys()
        assert all(torch.equal(want[k], got[k]) for k in want), f"{name} differs (killed at {kill_at})"
