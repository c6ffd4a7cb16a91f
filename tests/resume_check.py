"""The tiny training run that the kill-and-resume, elastic and DDP tests share, and helpers to run it,
SIGKILL it at a batch and compare what it left with an uninterrupted reference.

Every such test trains the same command (`train_command`), so one uninterrupted reference per process
count (the session fixture `reference_run` in conftest.py) serves them all.
"""

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

from extensions.callbacks import read_loss_log
from tests.conftest import REPO, TINY_TEST

BATCHES = 8  # 64 samples / 16 per batch = 4 batches an epoch: kills land mid- and across epochs
COMPOSER = str(REPO / ".venv/bin/composer") if (REPO / ".venv/bin/composer").exists() else "composer"
# `composer -n N` without Composer's launcher (tests/launch.py says where the real one runs).
# Each rank a new interpreter: for the tests that find a rank by its environment (/proc/PID/environ,
# psutil's Process.environ, holds what a process was started with; a forked rank's is the launcher's),
# and the FSDP2 references (tests/conftest.py).
LAUNCH_EXEC = [sys.executable, str(REPO / "tests/launch.py")]
# The ranks train, so the launcher imports the libraries under Composer once and forks them
# (tests/launch.py --preload).
LAUNCH = [*LAUNCH_EXEC, "--preload", "stack"]


def train_command(
    nproc: int,
    out: Path,
    shapes_mds: Path,
    *extra: str,
    save_folder=None,
    recipe: str = "tiny-cpu",
    launch: list[str] = LAUNCH,
) -> list[str]:
    """tests/dist_train.py (train.py plus saving each rank's final UNet and EMA weights) on the tiny
    recipe (or `recipe`, another tiny one), saving every batch, with the loss and sample-key logs the
    tests compare; `nproc` > 1 under `launch`."""
    launcher = [sys.executable] if nproc == 1 else [*launch, "-n", str(nproc)]
    return [
        *launcher,
        str(REPO / "tests/dist_train.py"),
        str(out),
        str(REPO / f"yamls/{recipe}.yaml"),
        *TINY_TEST,
        f"data.train.local={shapes_mds / 'mds'}",
        "~data.train.prepare",
        "data.train.num_canonical_nodes=2",  # the same global sample order on 1 and 2 processes
        f"trainer.max_duration={BATCHES}ba",
        "trainer.save_interval=1ba",
        "trainer.save_num_checkpoints_to_keep=-1",
        "trainer.autoresume=true",
        f"trainer.save_folder={save_folder or out / 'ckpt'}",
        "trainer.progress_bar=false",
        "algorithms.ema.half_life=3",
        f"+callbacks.loss_log={{_target_: extensions.callbacks.LossLog, path: {out / 'loss.jsonl'}}}",
        f"+callbacks.key_log={{_target_: tests.probes.KeyLog, path: {out / 'keys.jsonl'}}}",
        *extra,
    ]


def train_env(**extra: str) -> dict[str, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline", **extra}
    # This checkout alone, whatever PYTHONPATH `extra` copied from os.environ: the runs import
    # `tests.probes`, and torch-fidelity installs a top-level `tests` package of its own.
    env["PYTHONPATH"] = str(REPO)
    return env


def run(cmd: list[str], cwd, env, timeout=600) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def kill_point(low: int, high: int) -> tuple[int, float, str]:
    """A batch in [low, high] to kill at and the seconds to wait after it is logged (somewhere inside
    the next batch or its checkpoint write, not on a boundary), both from KILL_SEED if set, else a
    fresh seed; returns them with a line that says how to repeat the draw (put it in every assertion
    message)."""
    seed = int(os.environ.get("KILL_SEED") or random.randrange(2**32))
    draw = random.Random(seed)
    batch, delay = draw.randint(low, high), draw.uniform(0.0, 0.3)
    return batch, delay, f"killed {delay:.3f} s after batch {batch}; repeat with KILL_SEED={seed}"


def run_and_kill_at(cmd: list[str], cwd, env, loss_log: Path, batch: int, delay: float, timeout=300) -> None:
    """Start `cmd` in its own process group and SIGKILL the whole group `delay` seconds after `batch`
    is logged."""
    proc = subprocess.Popen(
        cmd, cwd=cwd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise AssertionError(f"training exited ({proc.returncode}) before batch {batch}")
            if loss_log.exists() and batch in read_loss_log(loss_log):
                time.sleep(delay)
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=30)
                return
            time.sleep(0.02)
        raise AssertionError(f"batch {batch} not reached in {timeout}s")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


def assert_same_run(reference: Path, resumed: Path, why: str, batches: int = BATCHES) -> None:
    """The resumed run logged the reference's losses for every batch and ended with its exact UNet
    and EMA weights."""
    assert read_loss_log(resumed / "loss.jsonl") == read_loss_log(reference / "loss.jsonl"), why
    assert sorted(read_loss_log(reference / "loss.jsonl")) == list(range(1, batches + 1))
    for name in ("unet-rank0.pt", "ema-rank0.pt"):
        want, got = torch.load(reference / name), torch.load(resumed / name)
        assert want.keys() == got.keys()
        assert all(torch.equal(want[k], got[k]) for k in want), f"{name} differs ({why})"


def composer_run(nproc: int, args: list[str], logs: Path) -> subprocess.CompletedProcess:
    """`composer -n nproc ARGS` (tests/launch.py) from the repo root, the output of ranks 1.. in
    logs/r{rank}.out|err."""
    logs_args = ["--stdout", str(logs / "r{rank}.out"), "--stderr", str(logs / "r{rank}.err")]
    cmd = [*LAUNCH, "-n", str(nproc), *logs_args, *args]
    return run(cmd, REPO, train_env(HF_HUB_OFFLINE="1"))
