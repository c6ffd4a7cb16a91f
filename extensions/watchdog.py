"""A hang watchdog: when training stops making progress, every rank writes its Python stacks and the
process exits with EXIT_CODE (75), so the job ends instead of burning its allocation, and a scheduler
restarts it from the newest checkpoint (launch/slurm.sbatch requeues a job that ended with 75).

    callbacks:
      watchdog:
        _target_: extensions.watchdog.HangWatchdog
        floor_s: 600

A daemon thread holds one deadline, which the training loop's events move; per batch that costs two
clock reads and a max over at most 50 floats (no collective, no tensor read, no lock):

    from (event)                       until                      allowance
    FIT_START                          the first batch's end      startup_s (compile, first data)
    BEFORE_DATALOADER (a batch)        that batch's end           max(floor_s, factor x the slowest of
                                                                  the last 50 batches), at most the
                                                                  longest of floor_s, eval_s, save_s
    BATCH_END, EPOCH_END, each         the next event             eval_s (sample grids, evaluation)
    evaluation event
    *_CHECKPOINT, FIT_END              the next batch's fetch     save_s (a save, a new epoch's
                                                                  iterator; the final save, exports)

A batch's time is from its fetch to its end; the first batch of a fit (compile) is not counted. The
watchdog is listed first among the callbacks (yamls/_base.yaml), so that other callbacks' work at a
batch's end falls under eval_s; Composer appends its checkpoint saver after all of them.

When the deadline passes while `Trainer.fit` is still on the stack of the thread that started it (a
fit that returned or raised is never judged), the thread logs one error line, writes every thread's
stack to stderr (faulthandler) and ends the process with os._exit(EXIT_CODE). While a fit runs,
SIGTERM also writes the stacks first (faulthandler, chained to the handler before it), so a rank that
the launcher stops because another rank's watchdog fired first leaves its stacks too.

Collectives: `dist_timeout` derives composer.Trainer's `dist_timeout` from the watchdog (recipes/
config.py applies it), longer than any allowance, so a rank waiting for a hung one is stopped by its
watchdog, with stacks and EXIT_CODE, and not by the collective's timeout. Not caught: a thread stuck
in C code while it holds the GIL also stops this thread; the collective timeout then ends the run.
"""

import faulthandler
import logging
import os
import signal
import sys
import threading
import time
from collections import deque

from composer.core import Callback, State
from composer.loggers import Logger
from composer.utils import dist

log = logging.getLogger(__name__)

# os.EX_TEMPFAIL (sysexits.h: "temporary failure; the user is invited to retry"). Nothing else in
# this stack exits with it: an uncaught exception is 1, Composer's SIGTERM handler 143, a signal
# 128 + N (NCCL's abort 134, the OOM killer 137).
EXIT_CODE = 75
# The collective timeout's lead over the watchdog's longest allowance: time for the watchdog thread
# to wake, write the stacks and exit first, even on a loaded host (it takes well under a second).
MARGIN_S = 60.0
WINDOW = 50  # batches whose slowest sets the bound: enough to hold the occasional slow one (a shard download)
WATCHDOG = f"{__name__}.HangWatchdog"  # the `_target_` that names it in yamls/


class HangClock:
    """The deadline and what it waits for, moved by the training loop's events; no thread, no
    Composer, and `now` injectable, so the timing rules are tested with a fake clock."""

    def __init__(self, floor_s, factor, startup_s, eval_s, save_s, now=time.monotonic):
        self.floor_s, self.factor, self.startup_s = floor_s, factor, startup_s
        self.eval_s, self.save_s = eval_s, save_s
        self.now = now
        self.batch_times: deque[float] = deque(maxlen=WINDOW)
        self.batches = 0  # batch ends since the fit started
        self.fetched_at: float | None = None
        # (monotonic deadline, allowance, what it waits for), or None: unwatched. One attribute, so
        # that the watching thread always reads a consistent triple.
        self.due: tuple[float, float, str] | None = None

    @property
    def cap(self) -> float:
        """The most a batch is allowed; the collective timeout is this plus MARGIN_S."""
        return max(self.floor_s, self.eval_s, self.save_s)

    @property
    def shortest(self) -> float:
        """No deadline is set closer than this, so the thread looks at least this often."""
        return min(a for a in (self.floor_s, self.eval_s, self.save_s, self.startup_s) if a is not None)

    def bound(self) -> float:
        return min(max(self.floor_s, self.factor * max(self.batch_times, default=0.0)), self.cap)

    def fit_start(self) -> None:
        self.batches, self.fetched_at = 0, None
        self._expect(self.startup_s, "the first batch (compile, first data)")

    def fetch(self, batch: int) -> None:
        self.fetched_at = self.now()
        if self.batches:  # the first batch keeps startup_s: it compiles
            self._expect(self.bound(), f"batch {batch}", at=self.fetched_at)

    def batch_end(self, batch: int) -> None:
        now = self.now()
        if self.batches and self.fetched_at is not None:
            self.batch_times.append(now - self.fetched_at)
        self.batches += 1
        self._expect(self.eval_s, f"the work after batch {batch} (callbacks, evaluation)", at=now)

    def between(self, what: str) -> None:
        """Work between batches other than a save: evaluation, callbacks at an epoch's end."""
        self._expect(self.eval_s, what)

    def saving(self, what: str) -> None:
        self._expect(self.save_s, what)

    def overdue(self) -> tuple[float, float, str] | None:
        due = self.due
        return due if due is not None and self.now() >= due[0] else None

    def _expect(self, allowance: float | None, what: str, at: float | None = None) -> None:
        if allowance is None:
            self.due = None
        else:
            self.due = ((self.now() if at is None else at) + allowance, allowance, what)


class HangWatchdog(Callback):
    """Ends a hung run with every thread's stack and exit code EXIT_CODE (the module's docstring has
    the rules). Allowances in seconds; `startup_s: null` leaves the first batch unwatched."""

    def __init__(
        self,
        # torch's default NCCL collective timeout (torch.distributed.constants.default_pg_nccl_timeout,
        # 10 min): the field's line between slow and hung. A healthy batch's slowest known causes, a
        # shard download retried (data.train.download_timeout 60 s) or a recompile after evaluation
        # (a few minutes), stay well under it.
        floor_s: float = 600.0,
        # A batch ten times slower than the slowest of the last 50 is stuck, not slow; matters only
        # for batches over floor_s / 10 (60 s), such as many microbatches of a large model.
        factor: float = 10.0,
        # The first batch of a fit compiles (torch.compile with autotuning: tens of minutes for a
        # large model on a cold cache) and waits for the first shards.
        startup_s: float | None = 3600.0,
        # Each stretch of evaluation between eval batches, and the other callbacks' batch-end work:
        # sample grids (sd2-base: about 2 minutes on one GPU; a 12 B model several times that).
        eval_s: float = 1800.0,
        # A checkpoint save, ending with Composer's barrier (rank 0 writing sd2-base's ~14 GB at
        # 100 MB/s: 140 s; slow shared storage several times that), and the final save and exports.
        save_s: float = 1800.0,
    ):
        allowances = {"floor_s": floor_s, "startup_s": startup_s, "eval_s": eval_s, "save_s": save_s}
        for name, value in allowances.items():
            if value is not None and not value > 0:
                raise ValueError(f"{name}={value} must be more than 0 seconds")
        if not factor >= 1:
            raise ValueError(f"factor={factor} must be at least 1 (a multiple of the slowest recent batch)")
        self.clock = HangClock(float(floor_s), float(factor), startup_s, float(eval_s), float(save_s))
        self._fit_thread: int | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._sigterm = False

    @property
    def collective_timeout_s(self) -> float:
        return self.clock.cap + MARGIN_S

    def fit_start(self, state: State, logger: Logger) -> None:
        self._fit_thread = threading.get_ident()
        self.clock.fit_start()
        if self._thread is None or not self._thread.is_alive():
            self._stop = threading.Event()
            self._thread = threading.Thread(target=self._watch, name="hang-watchdog", daemon=True)
            self._thread.start()
        if not self._sigterm and hasattr(faulthandler, "register"):
            faulthandler.register(signal.SIGTERM, file=_stderr_fd(), all_threads=True, chain=True)
            self._sigterm = True

    def before_dataloader(self, state: State, logger: Logger) -> None:
        self.clock.fetch(int(state.timestamp.batch) + 1)

    def batch_end(self, state: State, logger: Logger) -> None:
        self.clock.batch_end(int(state.timestamp.batch))

    def epoch_end(self, state: State, logger: Logger) -> None:
        self.clock.between(f"the work at the end of epoch {int(state.timestamp.epoch)} (callbacks, eval)")

    def eval_before_all(self, state: State, logger: Logger) -> None:
        self._evaluating()

    def eval_start(self, state: State, logger: Logger) -> None:
        self._evaluating()

    def eval_batch_end(self, state: State, logger: Logger) -> None:
        self._evaluating()

    def eval_end(self, state: State, logger: Logger) -> None:
        self._evaluating()

    def eval_after_all(self, state: State, logger: Logger) -> None:
        self._evaluating()

    def batch_checkpoint(self, state: State, logger: Logger) -> None:
        self.clock.saving(f"a checkpoint save after batch {int(state.timestamp.batch)}")

    def epoch_checkpoint(self, state: State, logger: Logger) -> None:
        self.clock.saving(f"a checkpoint save after epoch {int(state.timestamp.epoch)}")

    def iteration_checkpoint(self, state: State, logger: Logger) -> None:
        self.clock.saving("a checkpoint save at the end of an iteration")

    def fit_end(self, state: State, logger: Logger) -> None:
        self.clock.saving("the end of training (final checkpoint, exports, evaluation)")

    def close(self, state: State, logger: Logger) -> None:
        self._stop.set()
        self.clock.due = None
        if self._sigterm:
            faulthandler.unregister(signal.SIGTERM)
            self._sigterm = False

    def _evaluating(self) -> None:
        if self._fit_thread is not None:  # not a trainer.eval() before any fit
            self.clock.between("evaluation")

    def _watch(self) -> None:
        while True:
            due = self.clock.due
            wait = self.clock.shortest if due is None else min(due[0] - self.clock.now(), self.clock.shortest)
            if self._stop.wait(max(wait, 0.0)):
                return
            due = self.clock.overdue()
            if due is None:
                continue
            if not self._in_fit():  # the fit returned or raised: nothing to wait for
                if self.clock.due is due:
                    self.clock.due = None
                continue
            self._fire(due)

    def _in_fit(self) -> bool:
        """`Trainer.fit` is on the stack of the thread that ran FIT_START."""
        from composer import Trainer

        frame = sys._current_frames().get(self._fit_thread)
        while frame is not None:
            if frame.f_code is Trainer.fit.__code__:
                return True
            frame = frame.f_back
        return False

    def _fire(self, due: tuple[float, float, str]) -> None:
        _, allowance, what = due
        log.error(
            "hang watchdog: rank %d waited %.0f s for %s; writing every thread's stack and exiting with "
            "code %d, so that a restart resumes from the newest checkpoint (docs/reliability.md)",
            dist.get_global_rank(),
            allowance,
            what,
            EXIT_CODE,
        )
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError, AttributeError):
                pass
        faulthandler.dump_traceback(file=_stderr_fd(), all_threads=True)
        self._exit(EXIT_CODE)

    _exit = staticmethod(os._exit)  # the tests replace it on an instance


def _stderr_fd() -> int:
    """The process's stderr as a file descriptor (faulthandler writes to one), also where sys.stderr
    is a stand-in without one (pytest's capture)."""
    try:
        return sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):
        return 2


def dist_timeout(callbacks: dict[str, dict], given: float | None) -> float | None:
    """composer.Trainer's `dist_timeout` (seconds, every collective's timeout) for a run with these
    callback specs: the watchdog's longest allowance plus MARGIN_S, or `given` (the YAML's
    trainer.dist_timeout) if longer; None without a watchdog (Composer's default stands). A `given`
    shorter than that is a ValueError: a rank waiting for a hung one would end by the collective's
    timeout, without stacks or EXIT_CODE."""
    needed = {
        name: HangWatchdog(**{k: v for k, v in spec.items() if not k.startswith("_")}).collective_timeout_s
        for name, spec in callbacks.items()
        if isinstance(spec, dict) and spec.get("_target_") == WATCHDOG
    }
    if not needed:
        return None
    name = max(needed, key=needed.get)
    if given is None:
        return needed[name]
    if given < needed[name]:
        raise ValueError(
            f"'trainer.dist_timeout' is {given:g} s, shorter than the hang watchdog needs "
            f"({needed[name]:g} s: the longest allowance of callbacks.{name} plus {MARGIN_S:g} s), so a rank "
            f"waiting for a hung one would end by the collective timeout, without stacks or exit code "
            f"{EXIT_CODE}; leave it unset (derived), raise it, or turn the watchdog off with "
            f"callbacks.{name}=null"
        )
    return float(given)
