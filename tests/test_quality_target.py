"""`callbacks.quality_target.target`: the first validation loss <= target saves the state and stops the
run, and the samples and wall time to it are logged (MLPerf's time to train); null only logs."""

import gc
import logging
import time
from types import SimpleNamespace

import pytest
import torch
from composer.core import Callback, Time, TimeUnit
from composer.loggers import InMemoryLogger

from extensions.quality_target import QualityTarget
from recipes import build_trainer, load_config, parse_config, train
from recipes.config import ConfigError
from tests.conftest import REPO, merged, tiny_run

BATCHES, EVERY, BATCH = 6, 2, 16  # an evaluation after batches 2, 4 and 6, of the 64-sample shapes set
METRIC = "FixedTimestepLoss"


def _config(shapes_mds, *extra):
    return load_config(
        REPO / "yamls/tiny-cpu.yaml",
        merged(
            *tiny_run(shapes_mds, BATCHES),
            f"+data.eval={{local: {shapes_mds / 'mds'}, resolution: 32}}",
            "+model.eval_timesteps=8",
            f"trainer.eval_interval={EVERY}ba",
            "scheduler.t_warmup=1ba",  # the full learning rate at once, so the loss falls within 6 batches
            "+loggers.memory={_target_: composer.loggers.InMemoryLogger}",
            *extra,
        ),
    )


class _EvalLosses(Callback):
    def __init__(self):
        self.values = {}

    def eval_end(self, state, logger):
        self.values[int(state.timestamp.batch)] = float(state.eval_metric_values[METRIC])


def _memory(trainer) -> InMemoryLogger:
    return next(d for d in trainer.logger.destinations if isinstance(d, InMemoryLogger))


@pytest.fixture(scope="module")
def measured(shapes_mds) -> dict[int, float]:
    """batch -> validation loss of the tiny run without a target (which only logs)."""
    trainer = build_trainer(_config(shapes_mds))
    losses = _EvalLosses()
    trainer.state.callbacks.append(losses)
    trainer.fit()
    assert int(trainer.state.timestamp.batch) == BATCHES  # no target: it trained to the end
    assert not any(key.startswith("quality_target/") for key in _memory(trainer).data)
    trainer.close()
    del trainer
    gc.collect()
    assert list(losses.values) == list(range(EVERY, BATCHES + 1, EVERY))
    return losses.values


@pytest.mark.fit
def test_the_first_validation_under_the_target_saves_and_stops_the_run(
    measured, shapes_mds, tmp_path, caplog
):
    first, *middle, last = measured.values()
    assert min(middle) < first, measured  # the tiny model learns, so a target fits in between
    target = (first + min(middle)) / 2
    stop = next(batch for batch, loss in measured.items() if loss <= target)
    assert EVERY < stop < BATCHES  # not at the first validation (above the target), nor at the end
    save = tmp_path / "checkpoints"
    config = _config(shapes_mds, f"trainer.save_folder={save}", f"callbacks.quality_target.target={target}")
    started = time.monotonic()
    with caplog.at_level(logging.INFO, logger="extensions.quality_target"):
        trainer = build_trainer(config)
        trainer.fit()
    took = time.monotonic() - started

    assert int(trainer.state.timestamp.batch) == stop  # stopped there, with max_duration 6 batches
    # Saved at the stop (the tiny recipe's save_interval, 500 batches, saves nothing else).
    saved = sorted(p.name for p in save.glob("ep*.pt"))
    assert saved and {name.split("-")[1] for name in saved} == {f"ba{stop}"}, saved
    state = torch.load(save / saved[0], weights_only=False)["state"]
    reached = state["callbacks"]["QualityTarget"]["reached"]
    assert reached["batches"] == stop and reached["samples"] == stop * BATCH
    assert reached["loss"] == pytest.approx(measured[stop])  # the same validation loss as the first run
    # Time to target, in every logger and in the log: samples, and wall seconds from the fit's start.
    logged = {key: values[-1][1] for key, values in _memory(trainer).data.items()}
    assert logged["quality_target/samples_to_target"] == stop * BATCH
    assert 0 < logged["quality_target/time_to_target_s"] < took
    assert logged["quality_target/time_to_target_s"] == reached["time_s"]
    messages = [r.getMessage() for r in caplog.records]
    assert sum(m.startswith(f"validation {METRIC}") for m in messages) == stop // EVERY
    assert any(
        m.startswith("run_stop: status success") and f"after {stop * BATCH} samples" in m for m in messages
    )
    trainer.close()
    del trainer
    gc.collect()

    # Rerunning the command (autoresume from the checkpoint of the stop) trains nothing more, and says
    # why, naming the run's trainer.max_duration (not the stop's batch, which stop_training leaves).
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="extensions.quality_target"):
        rerun = train(config)
    assert int(rerun.state.timestamp.batch) == stop
    (said,) = [r.getMessage() for r in caplog.records if "reached its quality target" in r.getMessage()]
    assert f"batch {stop}; trainer.max_duration={BATCHES}ba); nothing to train" in said, said
    assert not [r for r in caplog.records if "is complete" in r.getMessage()]  # not also "raise max_duration"
    assert sorted(p.name for p in save.glob("ep*.pt")) == saved


class _State(SimpleNamespace):
    stopped = False
    max_duration = None

    def stop_training(self):
        """Composer's: max_duration becomes the batch it stops at."""
        self.stopped = True
        if self.max_duration is not None:
            self.max_duration = Time(int(self.timestamp.batch), TimeUnit.BATCH)


def _evaluate(callback, loss, batch=3, metrics=METRIC):
    state = _State(
        eval_metric_values={name: torch.tensor(loss) for name in metrics.split()},
        timestamp=SimpleNamespace(sample=batch * BATCH, batch=batch),
        evaluators=["eval"],
        run_name="r",
    )
    logged = {}
    callback.eval_after_all(state, SimpleNamespace(log_metrics=logged.update))
    return state.stopped, logged


def test_without_a_target_or_above_it_the_run_goes_on(caplog):
    with caplog.at_level(logging.INFO, logger="extensions.quality_target"):
        assert _evaluate(QualityTarget(), 0.1) == (False, {})
        assert _evaluate(QualityTarget(target=0.5), 0.6) == (False, {})
        stopped, logged = _evaluate(QualityTarget(target=0.5), 0.5)  # <=: a loss at the target reaches it
    assert stopped and logged["quality_target/samples_to_target"] == 3 * BATCH
    assert [r.getMessage().split(" at ")[0] for r in caplog.records][:2] == [f"validation {METRIC} 0.1"] + [
        f"validation {METRIC} 0.6"
    ]


def test_a_run_that_ends_above_the_target_logs_run_stop_aborted(caplog):
    callback = QualityTarget(target=0.5)
    state = _State(
        timestamp=SimpleNamespace(sample=6 * BATCH, batch=6),
        evaluators=["eval"],
        run_name="r",
        max_duration=Time.from_timestring("6ba"),
    )
    with caplog.at_level(logging.INFO, logger="extensions.quality_target"):
        callback.fit_start(state, None)
        _evaluate(callback, 0.7)
        callback.close(state, None)
        callback.close(state, None)  # Composer may close twice: one line
    aborted = [
        r.getMessage() for r in caplog.records if r.getMessage().startswith("run_stop: status aborted")
    ]
    assert len(aborted) == 1 and f"at {6 * BATCH} samples (batch 6; trainer.max_duration=6ba)" in aborted[0]
    with pytest.raises(ValueError, match="target=nan must be a validation loss"):
        QualityTarget(target=float("nan"))


def test_the_lines_at_the_stop_and_on_a_rerun_name_the_run_s_own_max_duration(caplog):
    """The run's trainer.max_duration (6ba), not the one state.stop_training() leaves (the batch it
    stopped at): at the stop, and in the rerun of a run that reached its target (issue 47)."""
    state = _State(
        timestamp=SimpleNamespace(sample=2 * BATCH, batch=2),
        eval_metric_values={METRIC: torch.tensor(0.4)},
        evaluators=["eval"],
        run_name="r",
        max_duration=Time.from_timestring("6ba"),
    )
    callback = QualityTarget(target=0.5)
    with caplog.at_level(logging.INFO, logger="extensions.quality_target"):
        callback.after_load(state, None)  # a fresh run: nothing loaded
        callback.fit_start(state, None)
        callback.eval_after_all(state, SimpleNamespace(log_metrics=dict))
        callback.close(state, None)
    assert state.stopped and state.max_duration == Time(2, TimeUnit.BATCH)  # Composer's stop
    (stop,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("run_stop")]
    assert stop.startswith("run_stop: status success") and "trainer.max_duration=6ba;" in stop, stop
    saved = callback.state_dict()

    caplog.clear()  # the rerun: a new process, the same command, autoresume loads the stop's state
    rerun = QualityTarget(target=0.5)
    rerun.load_state_dict(saved)
    state = _State(
        timestamp=SimpleNamespace(sample=2 * BATCH, batch=2),
        run_name="r",
        max_duration=Time.from_timestring("6ba"),
    )
    with caplog.at_level(logging.INFO, logger="extensions.quality_target"):
        rerun.after_load(state, None)
    assert state.stopped and state.max_duration == Time(2, TimeUnit.BATCH)  # nothing to train
    (line,) = [r.getMessage() for r in caplog.records]
    assert line.startswith("run r reached its quality target in the checkpoint it resumes (loss 0.4 <= 0.5")
    assert "at 32 samples, batch 2; trainer.max_duration=6ba); nothing to train" in line, line
    assert "trainer.max_duration=2ba" not in line

    # A lower target goes on, to the run's max_duration.
    state = _State(timestamp=SimpleNamespace(sample=2 * BATCH, batch=2), max_duration=Time(6, TimeUnit.BATCH))
    lower = QualityTarget(target=0.3)
    lower.load_state_dict(saved)
    lower.after_load(state, None)
    assert not state.stopped and lower.reached is None


def test_the_metric_is_the_fixed_timestep_loss_when_measured_else_the_mse():
    callback = QualityTarget(target=0.5)
    assert _evaluate(callback, 0.4, metrics="MeanSquaredError")[0]
    callback = QualityTarget(target=0.5)  # both measured: the fixed-timestep loss decides
    state = _State(
        eval_metric_values={"MeanSquaredError": torch.tensor(0.4), METRIC: torch.tensor(0.6)},
        timestamp=SimpleNamespace(sample=0, batch=0),
    )
    callback.eval_after_all(state, SimpleNamespace(log_metrics=dict))
    assert not state.stopped
    with pytest.raises(
        ValueError, match=r"metric='Accuracy' was not measured; the evaluation measured \['Fixed"
    ):
        _evaluate(QualityTarget(metric="Accuracy"), 0.1)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["callbacks.quality_target.target=0.5"],
            r"'callbacks.quality_target.target' is set but the run has no",
        ),
        (
            ["callbacks.quality_target.target=low"],
            r"^'callbacks.quality_target.target' must be a number, got 'low'$",
        ),
    ],
)
def test_a_target_that_cannot_work_is_a_one_line_config_error(overrides, message):
    with pytest.raises(ConfigError, match=message):
        parse_config(load_config(REPO / "yamls/tiny-cpu.yaml", overrides))
