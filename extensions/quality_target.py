"""Stop a run at a quality target and log its time to train: how MLPerf Training judges a run.

    callbacks:
      quality_target:
        _target_: extensions.quality_target.QualityTarget
        target: 0.586  # MLPerf's Flux target; null (yamls/_base.yaml): only log each validation loss
        metric: null   # FixedTimestepLoss with model.eval_timesteps, else MeanSquaredError

After every evaluation (Composer's EVAL_AFTER_ALL; how often is `trainer.eval_interval`: MLPerf's Flux
benchmark evaluates every 262,144 training samples, `trainer.eval_interval=262144sp`) it logs the
validation loss. At the first one <= `target` it logs the samples and wall time to the target
(`quality_target/samples_to_target`, `quality_target/time_to_target_s`, to every logger and as a log
line) and calls `state.stop_training()`, which sets max_duration to the current batch. Composer runs
the checkpoint saver after the evaluators, at the same batch's BATCH_CHECKPOINT (EPOCH_CHECKPOINT for
an epoch-end evaluation), and its interval also fires at the end of training: so this state is saved
(when the run has a save_folder), then the loop ends. All ranks read the same loss (the metric is
reduced across them), so all stop at the same batch.

The time is MLPerf's time to train, from run_start to run_stop: wall seconds from FIT_START,
evaluations and saves included, plus those of the runs this one resumed, as far as their last
checkpoint (kept in this callback's state in the checkpoint). Log lines mark `run_start` and
`run_stop` (status success, or aborted when training ends above the target). A rerun of a run that
reached its target (autoresume loads the checkpoint saved at the stop) trains nothing more, unless
the target is lowered below the loss it reached; `target: null` trains on.
"""

import logging
import math
import time

from composer.core import Callback, State
from composer.loggers import Logger
from composer.utils import dist

log = logging.getLogger(__name__)

TARGET = f"{__name__}.QualityTarget"  # the `_target_` that recipes/config.py looks for
# The metric read when `metric` is null, first found first: MLPerf's loss at fixed timesteps when the
# model measures it (model.eval_timesteps: models/engine/eval_timesteps.py), else the seeded validation MSE.
DEFAULT_METRICS = ("FixedTimestepLoss", "MeanSquaredError")


def config_problem(callbacks: dict, eval_data, trainer: dict | None = None) -> str | None:
    """A quality target the run could never judge: no `data.eval` to measure it on, or a
    `trainer.eval_interval` (or `trainer.eval_subset_num_batches`) that evaluates nothing. (A target
    that no loss can reach, 0 or below, is refused by QualityTarget itself.)"""
    trainer = trainer or {}
    for name, spec in callbacks.items():
        if spec.get("_target_") != TARGET or spec.get("target") is None:
            continue
        key = f"callbacks.{name}.target"
        if eval_data is None:
            return (
                f"'{key}' is set but the run has no data.eval to measure it on; add "
                f"data.eval and trainer.eval_interval, or set {key}=null"
            )
        interval = trainer.get("eval_interval")
        if interval is not None and evaluates_never(interval):
            return (
                f"'trainer.eval_interval' is {interval!r}, which never evaluates, so {key}={spec['target']} "
                f"can never be judged; set trainer.eval_interval to a positive interval (e.g. 1000ba, "
                f"262144sp or 1ep), or {key}=null"
            )
        batches = trainer.get("eval_subset_num_batches")
        if isinstance(batches, int) and not isinstance(batches, bool) and batches == 0:
            return (
                f"'trainer.eval_subset_num_batches' is 0, which evaluates no batch, so {key}="
                f"{spec['target']} can never be judged; set it to -1 (the whole data.eval) or a positive "
                f"number of batches, or {key}=null"
            )
    return None


def evaluates_never(interval) -> bool:
    """Composer's evaluator never runs at an interval of 0 or less (`create_interval_scheduler`), and
    0 is how its docs turn evaluation off. An interval it cannot parse is left to Composer."""
    from composer.core import Time, TimeUnit

    if isinstance(interval, bool):
        return False
    try:
        value = Time.from_input(interval, TimeUnit.EPOCH).value
    except (ValueError, TypeError):
        return False
    return value <= 0


class QualityTarget(Callback):
    """See the module docstring. `target`: the validation loss that ends the run (null: log only);
    `metric`: the eval metric compared with it (null: DEFAULT_METRICS)."""

    def __init__(self, target: float | None = None, metric: str | None = None):
        if target is not None and (
            isinstance(target, bool) or not isinstance(target, int | float) or not math.isfinite(target)
        ):
            raise ValueError(f"target={target!r} must be a validation loss (a number) or null")
        if target is not None and target <= 0:
            # Both metrics (DEFAULT_METRICS, and any a model measures here) are mean squared errors.
            raise ValueError(
                f"target={target!r} can never be reached: the validation loss is a mean squared error, "
                "never below 0; a target must be > 0 (or null: only log the validation loss)"
            )
        self.target = None if target is None else float(target)
        self.metric = metric
        self.reached: dict | None = None  # loss, samples, batches, time_s at the first loss <= target
        self._earlier_s = 0.0  # wall seconds of the runs this one resumed, to their last checkpoint
        self._start: float | None = None  # time.monotonic() at this process's FIT_START
        self._closed = False
        # The run's trainer.max_duration, read before anything stops the run: state.stop_training()
        # (this callback's, at the target or at load) sets state.max_duration to the batch it stops at.
        self._max_duration = None

    def elapsed_s(self) -> float:
        """Wall seconds of training so far, resumed runs included (MLPerf's time to train)."""
        return self._earlier_s + (0.0 if self._start is None else time.monotonic() - self._start)

    def state_dict(self) -> dict:
        return {"elapsed_s": self.elapsed_s(), "reached": self.reached}

    def load_state_dict(self, state: dict) -> None:
        self._earlier_s = float(state.get("elapsed_s", 0.0))
        self.reached = state.get("reached")

    def after_load(self, state: State, logger: Logger) -> None:
        self._max_duration = state.max_duration
        if self.reached is None:
            return
        if self.target is not None and self.reached["loss"] <= self.target:
            log.warning(
                "run %s reached its quality target in the checkpoint it resumes (loss %.6g <= %g at %d "
                "samples, batch %d; trainer.max_duration=%s); nothing to train (a target below %.6g, or "
                "callbacks.quality_target.target=null, trains on to trainer.max_duration)",
                state.run_name,
                self.reached["loss"],
                self.target,
                self.reached["samples"],
                self.reached["batches"],
                state.max_duration,
                self.reached["loss"],
            )
            state.stop_training()  # sets state.max_duration to this batch: anything logged after reads that
        else:
            self.reached = None  # a lower target (or none): the run goes on, and may reach the new one

    def fit_start(self, state: State, logger: Logger) -> None:
        if self.target is not None and not state.evaluators:
            raise ValueError("callbacks.quality_target.target is set but the run has no eval set")
        self._start = time.monotonic()
        if self._max_duration is None:  # no AFTER_LOAD (a state built by hand)
            self._max_duration = state.max_duration
        if dist.get_global_rank() == 0:
            log.info(
                "run_start: run %s, quality target %s, %.1f s trained before",
                state.run_name,
                "none (logging only)" if self.target is None else self.target,
                self._earlier_s,
            )

    def eval_after_all(self, state: State, logger: Logger) -> None:
        name = self._metric_name(state)
        loss = float(state.eval_metric_values[name])
        samples, batches = int(state.timestamp.sample), int(state.timestamp.batch)
        elapsed = self.elapsed_s()
        if dist.get_global_rank() == 0:
            log.info(
                "validation %s %.6g at %d samples (batch %d), %.1f s into the run; target %s",
                name, loss, samples, batches, elapsed, self.target,
            )  # fmt: skip
        if self.target is None or self.reached is not None or not loss <= self.target:
            return
        self.reached = {"loss": loss, "samples": samples, "batches": batches, "time_s": elapsed}
        logger.log_metrics(
            {
                "quality_target/samples_to_target": samples,
                "quality_target/batches_to_target": batches,
                "quality_target/time_to_target_s": elapsed,
                "quality_target/loss": loss,
            }
        )
        if dist.get_global_rank() == 0:
            log.info(
                "run_stop: status success: %s %.6g <= target %g after %d samples (batch %d), %.1f s; "
                "stopping (trainer.max_duration=%s; the end-of-training checkpoint holds these weights)",
                name, loss, self.target, samples, batches, elapsed, self._max_duration,
            )  # fmt: skip
        state.stop_training()

    def close(self, state: State, logger: Logger) -> None:
        # At close, not FIT_END: Composer's evaluation at the end of training runs after FIT_END.
        if self._start is None or self.target is None or self.reached is not None or self._closed:
            return
        self._closed = True
        if dist.get_global_rank() == 0:
            log.info(
                "run_stop: status aborted: training ended at %d samples (batch %d; trainer.max_duration=%s), "
                "%.1f s, without a validation loss <= %g",
                int(state.timestamp.sample),
                int(state.timestamp.batch),
                self._max_duration,
                self.elapsed_s(),
                self.target,
            )

    def _metric_name(self, state: State) -> str:
        measured = state.eval_metric_values
        if self.metric is not None:
            if self.metric not in measured:
                raise ValueError(
                    f"callbacks.quality_target.metric={self.metric!r} was not measured; the evaluation "
                    f"measured {sorted(measured)}"
                )
            return self.metric
        name = next((n for n in DEFAULT_METRICS if n in measured), None)
        if name is None:
            raise ValueError(
                f"callbacks.quality_target: none of {list(DEFAULT_METRICS)} was measured; name one of "
                f"{sorted(measured)} in callbacks.quality_target.metric"
            )
        return name
