"""The hang watchdog (extensions/watchdog.py): its timing rules on a fake clock, the collective timeout
it derives, the Slurm requeue of its exit code, and the acceptance of issue 39: one rank of a
2-process CPU run stopped with SIGSTOP ends the whole job with the watchdog's code and its stacks."""

import os
import re
import signal
import subprocess
import threading
import time
from pathlib import Path

import psutil
import pytest

from extensions.watchdog import EXIT_CODE, MARGIN_S, WINDOW, HangClock, HangWatchdog, dist_timeout
from recipes import load_config
from recipes.config import ConfigError, parse_config
from tests.conftest import REPO, TINY_TEST
from tests.resume_check import LAUNCH_EXEC, train_env


def _stack(thread: str, file: str) -> str:
    """A regex for faulthandler's dump of a thread ("Current thread" or "Thread") with `file` in its stack."""
    return rf"(^|\n){thread} 0x[0-9a-f]+ \(most recent call first\):\n(  File .*\n)*?  File .*{file}"


class FakeClock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def _clock(**allowances) -> tuple[HangClock, FakeClock]:
    now = FakeClock()
    options = dict(floor_s=10.0, factor=4.0, startup_s=100.0, eval_s=50.0, save_s=60.0) | allowances
    return HangClock(**options, now=now), now


def _batch(clock: HangClock, now: FakeClock, batch: int, seconds: float) -> None:
    """One batch as Composer runs it: fetch, `seconds` of data and step, end, then a checkpoint event."""
    clock.fetch(batch)
    now.t += seconds
    assert clock.overdue() is None
    clock.batch_end(batch)
    clock.saving(f"a checkpoint save after batch {batch}")


def _late_after(clock: HangClock, now: FakeClock) -> float:
    """Seconds from now until the deadline passes (and not a moment before)."""
    start = now.t
    now.t = clock.due[0] - 1e-6
    assert clock.overdue() is None
    now.t = clock.due[0]
    assert clock.overdue() is not None
    return now.t - start


def test_the_first_batch_has_the_startup_allowance_and_is_not_counted():
    clock, now = _clock()
    clock.fit_start()
    clock.fetch(1)  # compiling: the floor (10 s) does not apply yet
    assert clock.due[2].startswith("the first batch")
    now.t += 99.0
    assert clock.overdue() is None
    clock.batch_end(1)
    assert list(clock.batch_times) == []  # 99 s of compile would have raised the bound to 396 s
    clock.fetch(2)
    assert _late_after(clock, now) == pytest.approx(10.0)  # no history yet: the floor


def test_the_bound_is_the_floor_or_factor_times_the_slowest_recent_batch():
    clock, now = _clock()
    clock.fit_start()
    _batch(clock, now, 1, 1.0)
    for batch in range(2, 12):
        _batch(clock, now, batch, 2.0)
    assert clock.bound() == 10.0  # 4 x 2 s < the floor
    _batch(clock, now, 12, 5.0)  # a slow batch (a shard download): 4 x 5 s > the floor
    clock.fetch(13)
    assert _late_after(clock, now) == pytest.approx(20.0)
    assert clock.due[2] == "batch 13"
    for batch in range(14, 14 + WINDOW):  # the slow one leaves the window
        _batch(clock, now, batch, 2.0)
    assert clock.bound() == 10.0
    _batch(clock, now, 100, 9.0)  # slower and slower batches, each within the bound before it
    _batch(clock, now, 101, 30.0)  # 4 x 30 s is capped at the longest allowance (save_s, 60 s)
    assert clock.bound() == 60.0


def test_evaluation_and_saves_have_their_own_allowances():
    clock, now = _clock()
    clock.fit_start()
    _batch(clock, now, 1, 1.0)
    clock.fetch(2)
    now.t += 2.0
    clock.batch_end(2)  # then sample grids and evaluation: eval_s for each stretch, not the floor
    assert _late_after(clock, now) == pytest.approx(50.0)
    for _ in range(3):  # eval batches: each one moves the deadline
        now.t -= 1.0
        clock.between("evaluation")
        now.t += 49.0
        assert clock.overdue() is None
    clock.saving("a checkpoint save after batch 2")  # the save, then the next epoch's iterator
    assert _late_after(clock, now) == pytest.approx(60.0)
    clock.fetch(3)  # back to the batch bound from the fetch on
    assert _late_after(clock, now) == pytest.approx(10.0)


def test_no_startup_allowance_leaves_the_first_batch_unwatched():
    clock, now = _clock(startup_s=None)
    clock.fit_start()
    clock.fetch(1)
    now.t += 1e6
    assert clock.due is None and clock.overdue() is None
    clock.batch_end(1)
    assert clock.due is not None


def test_the_thread_fires_only_while_fit_runs_and_writes_the_stacks(capfd, monkeypatch):
    """The real thread, with allowances of a few hundredths of a second: a fit that is running (its
    check replaced) and stalls is stopped with EXIT_CODE after the stacks; one that returned is not."""
    watchdog = HangWatchdog(floor_s=0.05, eval_s=0.05, save_s=0.05, startup_s=0.05)
    fired = threading.Event()
    codes = []

    def exit_(code):  # os._exit in a run; here the thread records the code and ends
        codes.append(code)
        fired.set()
        raise SystemExit

    watchdog._exit = exit_
    in_fit = [False]
    monkeypatch.setattr(watchdog, "_in_fit", lambda: in_fit[0])
    watchdog.fit_start(None, None)
    try:
        give_up = time.monotonic() + 10
        while watchdog.clock.due is not None and time.monotonic() < give_up:
            time.sleep(0.01)  # a fit that returned: the deadline passes, nothing fires, it is dropped
        assert codes == [] and watchdog.clock.due is None
        in_fit[0] = True
        watchdog.clock.fit_start()
        assert fired.wait(5.0), "the watchdog did not fire"
    finally:
        watchdog.close(None, None)
    assert codes[:1] == [EXIT_CODE]
    err = capfd.readouterr().err
    assert re.search(_stack("Current thread", r"extensions/watchdog\.py"), err)
    watchdog._thread.join(5.0)
    assert not watchdog._thread.is_alive()  # close() stops it


def test_only_a_running_fit_counts():
    watchdog = HangWatchdog()
    watchdog._fit_thread = threading.get_ident()
    assert not watchdog._in_fit()  # this test is no Trainer.fit


@pytest.mark.parametrize(
    ("option", "message"),
    [
        ("floor_s=0", "callbacks.watchdog.floor_s=0 must be more than 0 seconds"),
        ("factor=0.5", "callbacks.watchdog.factor=0.5 must be at least 1"),
        ("flor_s=5", "unknown config key 'callbacks.watchdog.flor_s'; did you mean 'floor_s'?"),
        ("save_s=fast", "'callbacks.watchdog.save_s' must be a number, got 'fast'"),
    ],
)
def test_a_bad_option_is_one_config_error(option, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        _trainer_options(f"callbacks.watchdog.{option}")


def _trainer_options(*overrides: str) -> dict:
    config = load_config(REPO / "yamls/tiny-cpu.yaml", ["model.pretrained=null", *overrides])
    return parse_config(config).trainer


@pytest.mark.heavy
def test_the_collective_timeout_is_derived_from_the_watchdog_in_one_place():
    watchdog = HangWatchdog()
    assert watchdog.collective_timeout_s == max(600.0, 1800.0, 1800.0) + MARGIN_S
    assert _trainer_options()["dist_timeout"] == watchdog.collective_timeout_s  # from _base.yaml
    assert _trainer_options("callbacks.watchdog.save_s=3000")["dist_timeout"] == 3000 + MARGIN_S
    assert _trainer_options("trainer.dist_timeout=7200")["dist_timeout"] == 7200  # longer: kept
    assert "dist_timeout" not in _trainer_options("callbacks.watchdog=null")  # Composer's default
    with pytest.raises(ConfigError, match=r"'trainer.dist_timeout' is 300 s, shorter than the hang watchdog"):
        _trainer_options("trainer.dist_timeout=300")
    assert dist_timeout({"other": {"_target_": "composer.callbacks.LRMonitor"}}, 300) is None


# --- launch/slurm.sbatch: a job the watchdog ended is put back in the queue ---


def _stub(folder: Path, name: str, body: str) -> None:
    path = folder / name
    path.write_text("#!/usr/bin/env bash\n" + body)
    path.chmod(0o755)


@pytest.mark.subprocess  # bash, with stand-ins for srun and scontrol
@pytest.mark.parametrize(
    ("code", "restarts", "requeued"), [(EXIT_CODE, 0, True), (EXIT_CODE, 3, False), (1, 0, False)]
)
def test_slurm_job_requeues_itself_when_the_watchdog_ended_it(tmp_path, code, restarts, requeued):
    requeue = f'test "$1" = requeue && echo "$*" >> {tmp_path}/log'
    _stub(tmp_path, "scontrol", f'test "$1" = show && echo node0; {requeue}\n')
    _stub(tmp_path, "srun", f"exit {code}\n")
    env = {
        "PATH": f"{tmp_path}:/usr/bin:/bin",
        "SLURM_SUBMIT_DIR": str(REPO),
        "SLURM_JOB_NODELIST": "node0",
        "SLURM_JOB_ID": "4242",
        "SLURM_NNODES": "1",
        "SLURM_RESTART_COUNT": str(restarts),
    }
    result = subprocess.run(
        ["bash", str(REPO / "launch/slurm.sbatch"), "yamls/tiny-cpu.yaml"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == code, result.stderr
    log = tmp_path / "log"
    assert (log.read_text() if log.exists() else "") == ("requeue 4242\n" if requeued else "")


# --- the acceptance: SIGSTOP one rank of a 2-process CPU run ---

FLOOR_S = 5.0  # the batch bound in this run, with factor 3: small, so the test is short


def _pids_by_rank(launcher: subprocess.Popen, deadline: float) -> dict[int, int]:
    while time.monotonic() < deadline:
        ranks = {}
        for child in psutil.Process(launcher.pid).children():
            try:
                ranks[int(child.environ()["RANK"])] = child.pid
            except (psutil.Error, KeyError):
                pass
        if len(ranks) == 2:
            return ranks
        time.sleep(0.2)
    raise AssertionError("the launcher did not start 2 ranks")


def _sigterm_pending(pid: int) -> bool:
    """SIGTERM waits for `pid` (stopped), as sent to the process: /proc's ShdPnd mask."""
    status = Path(f"/proc/{pid}/status").read_text()
    pending = int(re.search(r"^ShdPnd:\s*([0-9a-f]+)", status, re.M).group(1), 16)
    return bool(pending & (1 << (signal.SIGTERM - 1)))


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.mark.subprocess
def test_a_stopped_rank_ends_the_job_with_stacks_and_the_watchdog_code(shapes_mds, tmp_path):
    losses = tmp_path / "loss.jsonl"
    command = [
        *LAUNCH_EXEC,  # _pids_by_rank reads each rank's environment
        "-n",
        "2",
        "--stderr",
        str(tmp_path / "rank{rank}.stderr.txt"),
        "--stdout",
        str(tmp_path / "rank{rank}.stdout.txt"),
        str(REPO / "train.py"),
        str(REPO / "yamls/tiny-cpu.yaml"),
        *TINY_TEST,
        f"data.train.local={shapes_mds / 'mds'}",
        "~data.train.prepare",
        "trainer.max_duration=100000ba",
        "trainer.save_folder=null",
        "trainer.progress_bar=false",
        f"callbacks.watchdog.floor_s={FLOOR_S}",
        "callbacks.watchdog.factor=3",
        f"+callbacks.loss_log={{_target_: extensions.callbacks.LossLog, path: {losses}}}",
    ]
    rank0_log = tmp_path / "rank0.stderr.txt"
    with rank0_log.open("w") as err:
        launcher = subprocess.Popen(command, cwd=REPO, env=train_env(), stdout=err, stderr=err)
    pids: dict[int, int] = {}
    try:
        pids = _pids_by_rank(launcher, time.monotonic() + 30)
        deadline = time.monotonic() + 180  # generous: a guard, not a speed claim (2 busy cores)
        while not (losses.exists() and len(losses.read_text().splitlines()) >= 4):  # a few batches
            assert launcher.poll() is None and time.monotonic() < deadline, rank0_log.read_text()[-3000:]
            time.sleep(0.1)
        os.kill(pids[1], signal.SIGSTOP)
        stopped = time.monotonic()
        while _alive(pids[0]):  # rank 0 waits for rank 1 in a collective, then its watchdog fires
            assert time.monotonic() - stopped < FLOOR_S + 40, "rank 0 is still running"
            time.sleep(0.05)
        while not _sigterm_pending(pids[1]):  # the launcher stops the other rank
            assert launcher.poll() is None and time.monotonic() - stopped < FLOOR_S + 50
            time.sleep(0.05)
        os.kill(pids[1], signal.SIGCONT)  # the SIGTERM, pending while it was stopped, ends it
        code = launcher.wait(timeout=30)
    finally:
        for pid in (*pids.values(), launcher.pid):
            if _alive(pid):
                os.kill(pid, signal.SIGCONT)
                os.kill(pid, signal.SIGKILL)
        launcher.wait(timeout=30)
    text = rank0_log.read_text().split("\n--- ")[0]  # rank 0's own, not the launcher's copy of rank 1's
    assert code == EXIT_CODE, text[-3000:]
    waited = re.search(r"hang watchdog: rank 0 waited (\d+) s for batch \d+; writing every thread", text)
    assert waited and int(waited.group(1)) >= FLOOR_S, text[-3000:]  # the bound: the floor or more
    # faulthandler's dump: the watchdog's own thread, and the training thread waiting in the trainer.
    assert re.search(_stack("Current thread", r"extensions/watchdog\.py"), text), text[-3000:]
    assert re.search(_stack("Thread", r"composer/trainer/trainer\.py"), text), text[-3000:]
    # The stopped rank wrote its stacks when the launcher's SIGTERM reached it (faulthandler, chained).
    assert "most recent call first" in (tmp_path / "rank1.stderr.txt").read_text()
    assert not any(_alive(pid) for pid in (*pids.values(), launcher.pid))
