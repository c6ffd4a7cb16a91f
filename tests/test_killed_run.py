"""A run killed with SIGKILL (a preemption, the OOM killer) leaves no process of its own behind.

Composer 0.32.1 uploads the checkpoints of an `s3://` save_folder from processes it spawns (two pools
and a multiprocessing Manager), and none of them watches its parent: each SIGKILLed run left five
running for ever (measured here: three of ~780 MB, which import torch and Composer, the Manager and
multiprocessing's resource tracker). The recipe uploads from threads instead (compat/composer.py,
`upload_in_threads`), so whatever kills the run takes its uploads with it.
"""

import os
import signal
import subprocess
import sys
import time
import uuid

import psutil
import pytest

from tests.conftest import REPO, TINY_TEST
from tests.s3_server import BUCKET, s3_server  # noqa: F401  (fixture)

GRACE_S = 20  # how long the run's processes may take to go once its main process is killed


def _tagged(tag: str) -> list[psutil.Process]:
    """Every live process whose environment carries `tag` (the run's own and all it started,
    whoever their parent is by now)."""
    found = []
    for proc in psutil.process_iter():
        try:
            if proc.environ().get("SD_TEST_RUN_TAG") == tag and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


def _describe(procs: list[psutil.Process]) -> str:
    lines = []
    for proc in procs:
        try:
            rss = proc.memory_info().rss / 2**20
            lines.append(f"pid {proc.pid} ({rss:.0f} MB): {' '.join(proc.cmdline())[:200]}")
        except psutil.Error:
            lines.append(f"pid {proc.pid} (gone while listed)")
    return "\n".join(lines)


def _assert_gone(tag: str, killed: str) -> None:
    """Within GRACE_S of the kill, no process carrying `tag` runs any more."""
    deadline = time.monotonic() + GRACE_S
    while (left := _tagged(tag)) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not left, f"{GRACE_S} s after {killed} was killed, still running:\n{_describe(left)}"


def test_a_run_killed_mid_upload_leaves_no_process_behind(s3_server, shapes_mds, tmp_path):  # noqa: F811
    """train.py with an s3:// save_folder, a checkpoint every batch, SIGKILLed (its main process
    alone, as the OOM killer does) once its first checkpoint is in the bucket, while the next ones
    upload: within GRACE_S nothing it started may still run."""
    tag = uuid.uuid4().hex
    prefix = f"killed-{tmp_path.name}"
    cmd = [
        sys.executable,
        str(REPO / "train.py"),
        str(REPO / "yamls/tiny-cpu.yaml"),
        *TINY_TEST,
        f"data.train.local={shapes_mds / 'mds'}",
        "~data.train.prepare",
        "data.train.num_workers=1",  # a DataLoader worker too: it must go as well
        "trainer.max_duration=400ba",  # killed long before its end
        "trainer.save_interval=1ba",
        f"trainer.save_folder=s3://{BUCKET}/{prefix}",
        "trainer.progress_bar=false",
    ]
    env = s3_server.env(OMP_NUM_THREADS="1", PYTHONPATH=str(REPO), SD_TEST_RUN_TAG=tag)
    client = s3_server.client()
    stderr = tmp_path / "stderr.txt"
    with stderr.open("w") as err:
        proc = subprocess.Popen(
            cmd, cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=err, start_new_session=True
        )
    try:
        deadline = time.monotonic() + 300
        while not client.list_objects_v2(Bucket=BUCKET, Prefix=f"{prefix}/ep").get("KeyCount"):
            assert proc.poll() is None, f"training exited ({proc.returncode}): {stderr.read_text()[-3000:]}"
            assert time.monotonic() < deadline, "no checkpoint reached the bucket in 300 s"
            time.sleep(0.1)
        # The run and what it started (a DataLoader worker, multiprocessing's resource tracker): all
        # of them must go, not the killed process alone.
        started = _tagged(tag)
        assert len(started) > 1, f"the run started no process of its own:\n{_describe(started)}"
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)

        _assert_gone(tag, "the run")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        for leftover in _tagged(tag):  # never leave them to the rest of the suite
            leftover.kill()


@pytest.mark.subprocess
def test_ranks_end_with_a_killed_launcher(shapes_mds, tmp_path):
    """`composer -n 2 train.py ...` with its launcher SIGKILLed (the ranks are left running by the
    launcher, which gets no chance to stop them): each rank asked Linux to kill it with its parent
    (common/lifetime.py), so within GRACE_S none of the job is left to train on and save beside a
    rerun."""
    from tests.resume_check import COMPOSER, train_env

    tag = uuid.uuid4().hex
    loss_log = tmp_path / "loss.jsonl"
    cmd = [
        COMPOSER, "-n", "2", str(REPO / "train.py"), str(REPO / "yamls/tiny-cpu.yaml"), *TINY_TEST,
        f"data.train.local={shapes_mds / 'mds'}", "~data.train.prepare", "trainer.max_duration=400ba",
        f"trainer.save_folder={tmp_path / 'ckpt'}", "trainer.save_interval=1000ba",
        "trainer.progress_bar=false",
        f"+callbacks.loss_log={{_target_: extensions.callbacks.LossLog, path: {loss_log}}}",
    ]  # fmt: skip
    launcher = subprocess.Popen(
        cmd, cwd=tmp_path, env=train_env(SD_TEST_RUN_TAG=tag), stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 300
        while not (loss_log.exists() and loss_log.read_text().strip()):  # the ranks are training
            assert launcher.poll() is None, f"the job exited ({launcher.returncode}) before training"
            assert time.monotonic() < deadline, "no batch trained in 300 s"
            time.sleep(0.2)
        ranks = [p for p in _tagged(tag) if p.pid != launcher.pid]
        assert len(ranks) >= 2, _describe(ranks)
        os.kill(launcher.pid, signal.SIGKILL)
        launcher.wait(timeout=30)

        _assert_gone(tag, "the launcher")
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
            launcher.wait()
        for leftover in _tagged(tag):
            leftover.kill()
