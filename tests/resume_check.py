"""Helpers for the kill-and-resume tests: run a training command, SIGKILL it at a batch, rerun."""

import os
import random
import signal
import subprocess
import time
from pathlib import Path

from recipes.callbacks import read_loss_log


def run(cmd: list[str], cwd, env, timeout=600) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def run_and_kill_at(cmd: list[str], cwd, env, loss_log: Path, batch: int, timeout=300) -> None:
    """Start `cmd` in its own process group and SIGKILL the whole group once `batch` is logged."""
    proc = subprocess.Popen(
        cmd, cwd=cwd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise AssertionError(f"training exited ({proc.returncode}) before batch {batch}")
            if loss_log.exists() and batch in read_loss_log(loss_log):
                # Land somewhere inside the next batch (or its checkpoint write), not on a boundary.
                time.sleep(random.uniform(0.0, 0.3))
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=30)
                return
            time.sleep(0.02)
        raise AssertionError(f"batch {batch} not reached in {timeout}s")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
