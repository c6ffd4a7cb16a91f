"""Startup hygiene: streaming shared memory left behind by a killed run does not block the next run.

A StreamingDataset with a `remote` registers its `local` cache folder in shared memory; a run killed
with SIGKILL never unregisters it. Here `remote` is a plain folder (streaming copies shards from it
as it would from a bucket), so the test needs no server.
"""

import os
import signal
import subprocess
import sys
from pathlib import Path
from tempfile import gettempdir

import pytest

from data.streaming_base import host_lock
from recipes import build_trainer, load_config
from recipes.shm import SHM_DIR, _registered_locals
from tests.conftest import REPO, TINY_TEST

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not SHM_DIR.is_dir(), reason="POSIX shared memory is not under /dev/shm here"),
]

OPEN_AND_DIE = """
import os, signal, sys
from streaming import StreamingDataset
from data.streaming_base import host_lock
with host_lock():  # streaming alone races other jobs for a free prefix (see OPEN)
    dataset = StreamingDataset(remote=sys.argv[1], local=sys.argv[2], batch_size=1)
dataset[0]  # registered and reading
os.killpg(0, signal.SIGKILL)  # the whole group, python's resource tracker too: nothing cleans up
"""

OPEN = """
import sys
from streaming import StreamingDataset
from compat.streaming import shm_prefix
from data.streaming_base import host_lock
with host_lock():
    print(shm_prefix(StreamingDataset(remote=sys.argv[1], local=sys.argv[2], batch_size=1)))
"""
# Streaming alone finds a free prefix and then creates it, two steps: a plain StreamingDataset made
# while the other test worker registers one may pick the same number and fail (seen: FileExistsError
# '/001754_locals'). Our datasets register under this host lock (data/streaming_base.py), so the
# tests' plain datasets, standing for another job, take it too.


def _python(code: str, *args) -> subprocess.CompletedProcess:
    command = [sys.executable, "-c", code, *map(str, args)]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run(
        command, capture_output=True, text=True, timeout=300, start_new_session=True, env=env
    )


def _prefixes_naming(folder: Path) -> list[str]:
    return [
        block.name.split("_")[0]
        for block in SHM_DIR.glob("*_locals")
        if str(folder) in _registered_locals(block)
    ]


def test_killed_runs_shared_memory_does_not_block_the_next_run(shapes_mds, tmp_path):
    remote, cache = shapes_mds / "mds", tmp_path / "cache"
    killed = _python(OPEN_AND_DIE, remote, cache)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    (stale,) = _prefixes_naming(cache)  # the killed run's registration is still there

    # While its lock files survive, streaming steps over that prefix; once a temp-folder cleaner (or a
    # fresh container sharing the host's /dev/shm) has removed them, streaming refuses the folder. It
    # looks only up to the first free prefix, though: one freed below the stale one meanwhile (the
    # other test worker's) is taken without a look at the stale one.
    for lock in Path(gettempdir()).glob(f"{stale}_*_filelock"):
        lock.unlink()
    blocked = _python(OPEN, remote, cache)
    if blocked.returncode == 0:
        assert int(blocked.stdout) < int(stale), (blocked.stdout, stale)
    else:
        assert "Reused local directory" in blocked.stderr, blocked.stderr[-2000:]

    # The recipe removes the leftover at startup and trains.
    overrides = [
        *TINY_TEST,
        f"data.train.remote={remote}",
        f"data.train.local={cache}",
        "~data.train.prepare",
        "trainer.max_duration=1ba",
        f"trainer.save_folder={tmp_path / 'ckpt'}",
        "trainer.progress_bar=false",
    ]
    trainer = build_trainer(load_config(REPO / "yamls/tiny-cpu.yaml", overrides))
    assert len(_prefixes_naming(cache)) == 1  # this run's own registration only
    trainer.fit()
    assert int(trainer.state.timestamp.batch) == 1
    trainer.close()


def test_startup_leaves_a_live_jobs_registration_alone(shapes_mds, tmp_path):
    """Another job on the host (here: a dataset alive in this process) keeps its registration when a
    run starts on other folders. Streaming's own cleanup, which recipes/shm.py ran before, unlinked
    every prefix from 0 to the first free one, live or not."""
    from streaming import StreamingDataset

    from recipes.shm import clean_shared_memory

    with host_lock():  # see OPEN
        live = StreamingDataset(remote=str(shapes_mds / "mds"), local=str(tmp_path / "live"), batch_size=1)
    (prefix,) = _prefixes_naming(tmp_path / "live")
    clean_shared_memory([str(tmp_path / "other")])
    assert _prefixes_naming(tmp_path / "live") == [prefix]
    del live


HOLD = """
import os, signal, sys
from compat.streaming import shm_prefix
from data.streaming_base import StreamingBase
dataset = StreamingBase(local=sys.argv[1], batch_size=1)  # local only: jobs may share the folder
print(f"{shm_prefix(dataset):06d}", flush=True)
if sys.stdin.readline() == "die\\n":
    os.killpg(0, signal.SIGKILL)  # the whole group, python's resource tracker too: nothing cleans up
dataset[0]
print("read", flush=True)
"""


def _hold(folder: Path) -> subprocess.Popen:
    command = [sys.executable, "-c", HOLD, str(folder)]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.Popen(
        command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env, start_new_session=True
    )


def test_a_live_job_sharing_the_folder_keeps_its_registration_a_killed_one_does_not(shapes_mds):
    """Streaming lets jobs on one host share a local-only folder (a sweep over one dataset; the test
    workers over shapes_mds): a run starting beside a live one on the same folder removes nothing of
    it, and the live job reads on; the same job killed leaves a registration the next start removes."""
    from recipes.shm import clean_shared_memory

    folder = shapes_mds / "mds"
    for fate in ("go", "die"):
        with _hold(folder) as job:
            try:
                prefix = job.stdout.readline().strip()
                assert prefix in _prefixes_naming(folder)
                if fate == "go":
                    clean_shared_memory([str(folder)])
                    assert prefix in _prefixes_naming(folder)  # alive: left alone
                out, _ = job.communicate(f"{fate}\n", timeout=120)
            finally:
                if job.poll() is None:
                    os.killpg(job.pid, signal.SIGKILL)
        if fate == "go":
            assert job.returncode == 0 and out == "read\n", out
        else:
            assert job.returncode == -signal.SIGKILL and prefix in _prefixes_naming(folder)
            clean_shared_memory([str(folder)])
            assert prefix not in _prefixes_naming(folder)  # killed: removed
