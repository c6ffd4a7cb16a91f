"""Restartability: finished inputs are skipped, unfinished ones redone, a SIGKILL loses nothing."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from convert.storage import LocalStore
from tests.conftest import REPO
from tests.convert_fixtures import (
    done_markers,
    jpeg,
    make_i2d_tars,
    read_mds,
    run_cli,
    sample_members,
    write_stats,
    write_tar,
)


def rows_of(out: Path) -> list[tuple]:
    return [(r["key"], r["caption"], r["image"], r["width"], r["height"]) for r in read_mds(out)]


@pytest.mark.heavy
def test_rerun_skips_finished_inputs_and_redoes_the_rest(tmp_path):
    src, out = tmp_path / "shards", tmp_path / "out"
    make_i2d_tars(src, shards=4, per_shard=5)
    argv = ["img2dataset", "--src", src, "--out", out]
    assert run_cli(*argv) == 0
    first = rows_of(out)
    assert len(first) == 20

    # as if the run had died while writing input 00002: no marker, a half-written folder
    (out / "_done" / "00002.json").unlink()
    (out / "00002" / "shard.00007.mds").write_bytes(b"half a shard")
    kept = (out / "_done" / "00001.json").stat().st_mtime_ns
    assert run_cli(*argv) == 0
    report = json.loads((out / "convert-report.json").read_text())
    assert (report["inputs_done_this_run"], report["inputs_done"], report["samples_written"]) == (1, 4, 20)
    assert (out / "_done" / "00001.json").stat().st_mtime_ns == kept
    assert not (out / "00002" / "shard.00007.mds").exists()
    assert rows_of(out) == first


def test_other_options_are_refused_unless_overwrite(tmp_path, capsys):
    src, out = tmp_path / "shards", tmp_path / "out"
    make_i2d_tars(src, shards=2, per_shard=3)
    assert run_cli("img2dataset", "--src", src, "--out", out) == 0
    capsys.readouterr()
    assert run_cli("img2dataset", "--src", src, "--out", out, "--resize-max", "16") == 1
    assert "other options" in capsys.readouterr().err
    assert run_cli("img2dataset", "--src", src, "--out", out, "--resize-max", "16", "--overwrite") == 0
    assert {(r[3], r[4]) for r in rows_of(out)} == {(24, 16)}


@pytest.mark.subprocess
def test_two_workers_write_what_one_does(tmp_path):
    src = tmp_path / "shards"
    make_i2d_tars(src, shards=5, per_shard=4)
    assert run_cli("img2dataset", "--src", src, "--out", tmp_path / "one") == 0
    assert run_cli("img2dataset", "--src", src, "--out", tmp_path / "two", "--workers", "2") == 0
    assert rows_of(tmp_path / "one") == rows_of(tmp_path / "two")


@pytest.mark.subprocess
def test_workers_end_when_the_parent_has_a_sigterm_handler(tmp_path):
    """The pool ends its workers with SIGTERM. A parent whose SIGTERM handler does not exit (importing
    Composer installs one that raises SystemExit, which in a forked worker ran the parent's copied
    finalizers and could hang) passed it on to the workers, and the conversion never returned."""
    src = tmp_path / "shards"
    make_i2d_tars(src, shards=4, per_shard=2)
    argv = [
        "img2dataset",
        "--src",
        str(src),
        "--out",
        str(tmp_path / "out"),
        "--workers",
        "2",
        "--no-progress",
    ]
    script = (
        "import signal, sys\n"
        "signal.signal(signal.SIGTERM, lambda *args: None)  # a handler that does not end the process\n"
        "from convert.__main__ import main\n"
        f"sys.exit(main({argv!r}))\n"
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    try:
        result = subprocess.run(
            [sys.executable, "-c", script], cwd=REPO, env=env, capture_output=True, timeout=120
        )
    except subprocess.TimeoutExpired:
        pytest.fail("the conversion did not return: its workers outlived Pool.terminate()")
    assert result.returncode == 0, result.stderr.decode()[-2000:]
    assert len(rows_of(tmp_path / "out")) == 8


def slow_shards(src: Path, shards: int, per_shard: int) -> None:
    """Shards of 400x300 photos (a few distinct ones reused), slow enough to kill a resize run midway."""
    src.mkdir(parents=True)
    pool = [jpeg(400, 300, seed=s) for s in range(6)]
    for s in range(shards):
        members = []
        for i in range(per_shard):
            members += sample_members(f"{s:05d}{i:04d}", pool[(s + i) % len(pool)], f"shard {s} sample {i}")
        write_tar(src / f"{s:05d}.tar", members)
        write_stats(src, f"{s:05d}", per_shard)


def children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and f"\nPPid:\t{pid}\n" in (entry / "status").read_text():
                found.append(int(entry.name))
        except OSError:
            pass
    return found


@pytest.mark.slow
def test_sigkill_midway_then_rerun_gives_exactly_the_uninterrupted_result(tmp_path):
    src, out, reference = tmp_path / "shards", tmp_path / "out", tmp_path / "reference"
    slow_shards(src, shards=8, per_shard=40)
    argv = ["img2dataset", "--src", src, "--resize-max", "64", "--workers", "2"]
    cmd = [sys.executable, "-m", "convert", *map(str, argv), "--out", str(out), "--no-progress"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while not done_markers(out) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert proc.poll() is None, (
        f"the run ended before it could be killed: {proc.stderr.read().decode()[-2000:]}"
    )
    workers = children(proc.pid)
    assert len(workers) >= 2  # the pool's two workers
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    proc.stderr.close()
    for _ in range(200):  # the workers die with their parent (PR_SET_PDEATHSIG)
        if not any(Path(f"/proc/{w}").exists() and "State:\tZ" not in _status(w) for w in workers):
            break
        time.sleep(0.01)
    else:
        pytest.fail(f"worker processes {workers} outlived the killed conversion")
    done_before = len(done_markers(out))
    assert 0 < done_before < 8 and not (out / "index.json").exists()  # killed midway, nothing merged yet

    assert run_cli(*argv, "--out", out) == 0
    assert run_cli(*argv, "--out", reference) == 0
    report = json.loads((out / "convert-report.json").read_text())
    assert report["inputs_done"] == 8 and report["inputs_done_this_run"] <= 8 - done_before
    rows, expected = rows_of(out), rows_of(reference)
    assert len(rows) == 8 * 40 and len({r[0] for r in rows}) == len(rows)  # no duplicates
    assert rows == expected


# sd-convert whose pool workers, once forked and once a task waits in the pool's queue for them,
# announce themselves and wait for a `go` file before their initializer runs: the state of a worker
# that the pool was starting when the conversion was killed. (`inqueue` is a local of the stdlib's
# pool worker, which calls the initializer.)
PAUSED_WORKERS = """
import os, sys, time
from pathlib import Path
import convert.pipeline as pipeline
from convert.__main__ import main
hold, initializer = Path(os.environ["HOLD"]), pipeline._init_worker
def paused(*args):
    tasks = sys._getframe(1).f_locals["inqueue"]
    while not tasks._reader.poll(0.01):
        pass
    (hold / f"worker-{os.getpid()}").write_text("")
    while not (hold / "go").exists():
        time.sleep(0.01)
    initializer(*args)
pipeline._init_worker = paused
sys.exit(main(sys.argv[1:]))
"""


def alive(pid: int) -> bool:
    return Path(f"/proc/{pid}").exists() and "State:\tZ" not in _status(pid)


@pytest.mark.slow
def test_kill_while_workers_start_leaves_no_lock_and_no_worker(tmp_path):
    src, out, reference, hold = (
        tmp_path / "shards",
        tmp_path / "out",
        tmp_path / "reference",
        tmp_path / "hold",
    )
    make_i2d_tars(src, shards=4, per_shard=3)
    hold.mkdir()
    argv = ["img2dataset", "--src", src, "--workers", "2"]
    cmd = [sys.executable, "-c", PAUSED_WORKERS, *map(str, argv), "--out", str(out), "--no-progress"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HOLD": str(hold)}
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    workers: list[int] = []
    try:
        deadline = time.monotonic() + 120
        while len(workers) < 2 and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)
            workers = [int(p.name.removeprefix("worker-")) for p in hold.glob("worker-*")]
        assert len(workers) == 2, f"no pool started: {proc.stderr.read().decode()[-2000:]}"
        proc.kill()  # the parent dies while both workers are being started, with tasks queued
        proc.wait()
        # the rerun starts while the killed run's workers still exist: they must not hold the lock
        assert run_cli(*argv, "--out", out) == 0
        markers = {p.name: p.stat().st_mtime_ns for p in (out / "_done").iterdir()}
        (hold / "go").write_text("")
        deadline = time.monotonic() + 20
        while any(alive(w) for w in workers) and time.monotonic() < deadline:
            time.sleep(0.05)
        survivors = [w for w in workers if alive(w)]
        assert not survivors, f"workers {survivors} outlived the killed conversion"
        # and they took none of the queued tasks: nothing rewritten behind the rerun's back
        assert {p.name: p.stat().st_mtime_ns for p in (out / "_done").iterdir()} == markers
    finally:
        proc.stderr.close()
        for worker in workers:  # survivors, if the test failed: this test's workers only, by pid
            if alive(worker):
                os.kill(worker, signal.SIGKILL)
    assert run_cli(*argv, "--out", reference) == 0
    assert rows_of(out) == rows_of(reference)


def test_the_output_lock_belongs_to_the_converter_alone(tmp_path, capsys):
    src, out = tmp_path / "shards", tmp_path / "out"
    make_i2d_tars(src, shards=1, per_shard=2)
    store = LocalStore(str(out))
    with store.lock():
        assert run_cli("img2dataset", "--src", src, "--out", out) == 1
        assert "another sd-convert is writing there" in capsys.readouterr().err
        ready, started = os.pipe()
        child = os.fork()  # as the pool forks its workers while the converter holds the lock
        if child == 0:
            os.write(started, b"1")  # after fork's child handlers (convert.storage drops the lock)
            time.sleep(60)
            os._exit(0)
        os.close(started)
        # Wait until the child runs: on a busy machine it can be scheduled after the rerun below.
        assert os.read(ready, 1) == b"1"
        os.close(ready)
    try:
        assert run_cli("img2dataset", "--src", src, "--out", out) == 0  # the child lives on
    finally:
        os.kill(child, signal.SIGKILL)
        os.waitpid(child, 0)


def _status(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return "State:\tZ"
