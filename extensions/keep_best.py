"""`trainer.keep_best: true`: keep the run's best checkpoint by its held-out loss, beside the others.

The loss judged is `metrics/holdout/FixedTimestepLoss` with `data.train.holdout` (recipes/evaluators.py
adds that evaluator, at MLPerf's fixed timesteps), else data.eval's (`metrics/eval/...`,
FixedTimestepLoss when the model measures it, else MeanSquaredError); lower is better. When an
evaluation beats the best so far, Composer's CheckpointSaver saves that batch, if its interval would
not (its `save_interval` is widened to that batch: the same save, upload and `latest` link as any
other), and then, in the local save_folder:

    best -> best-ba{N}/          a symlink, replaced atomically (a rename over the old one)
    best-ba{N}/checkpoint.pt     the checkpoint, hard-linked (copied where the filesystem cannot link);
                                 a sharded checkpoint is `checkpoint/`, its files linked
    best-ba{N}/best.json         {"batch", "sample", "loss", "metric", "checkpoint": its own name}

`best-ba{N}/` is written under a temporary name and renamed, then `best` is pointed at it, then the
previous `best-ba{M}/` is removed: a kill at any point leaves `best` naming a whole folder. Nothing
else is deleted. Retention (`trainer.save_num_checkpoints_to_keep`, recipes/keep_checkpoints.py)
goes on as before: it deletes its own file names, and the hard link keeps the best one's data; none of
these names match a checkpoint pattern, so autoresume and retention never see them. A resumed run
reads best.json, so the best so far is remembered; a run that starts at batch 0 starts afresh.
"""

import json
import logging
import math
import os
import shutil
from pathlib import Path

from composer.core import Callback, Event, State
from composer.loggers import Logger
from composer.utils import dist, parse_uri

from common.atomic import atomic_path
from extensions.quality_target import DEFAULT_METRICS, evaluates_never

log = logging.getLogger(__name__)

BEST, RECORD, STEM = "best", "best.json", "checkpoint"
CHECKPOINT_EVENTS = (Event.BATCH_CHECKPOINT, Event.EPOCH_CHECKPOINT)


def config_problem(trainer: dict, holdout, eval_data) -> str | None:
    """Why `trainer.keep_best` cannot work in this run, in one line; None when it can (or is off)."""
    value = trainer.get("keep_best")
    if value is None or value is False:
        return None
    if value is not True:
        return f"'trainer.keep_best' must be true or false, got {value!r}"
    if holdout is None and eval_data is None:
        return (
            "'trainer.keep_best' is true but the run has no held-out loss to judge checkpoints by; set "
            "data.train.holdout (e.g. 0.01, or a number of samples) or add data.eval, or set "
            "trainer.keep_best=false"
        )
    folder = trainer.get("save_folder")
    if folder is None:
        return (
            "'trainer.keep_best' keeps one of the run's checkpoints, but trainer.save_folder is null; set it"
        )
    if parse_uri(str(folder))[0]:
        return (
            f"'trainer.keep_best' needs a local trainer.save_folder (the best checkpoint is a hard link "
            f"beside the others), not {folder}; save to a local or shared folder, or set "
            "trainer.keep_best=false"
        )
    if trainer.get("save_num_checkpoints_to_keep") == 0:
        return (
            "'trainer.keep_best' needs the checkpoint it keeps, but trainer.save_num_checkpoints_to_keep=0 "
            "deletes each one as it is saved; keep at least 1 (or -1: all)"
        )
    interval = trainer.get("eval_interval")
    if interval is not None and evaluates_never(interval):
        return (
            f"'trainer.eval_interval' is {interval!r}, which never evaluates, so trainer.keep_best has "
            "nothing to judge by; set it to a positive interval (e.g. 1000ba), or trainer.keep_best=false"
        )
    return None


def read_record(folder: Path) -> dict | None:
    """The best so far that `folder` records (best/best.json), or None."""
    path = folder / BEST / RECORD
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as err:  # unreadable: judged afresh, and said so
        log.warning("keep_best: cannot read %s (%s); the next evaluation starts the best afresh", path, err)
        return None


def _link_or_copy(source: str, target: str) -> None:
    try:
        os.link(source, target)
    except OSError:  # a filesystem without hard links (or another device): a copy keeps it too
        shutil.copy2(source, target)


def keep(source: Path, folder: Path, record: dict) -> Path:
    """Make `folder/best` the checkpoint at `source` (a file, or a sharded checkpoint's folder) with
    `record`, as the module docstring says; the new `best-ba{N}` folder."""
    name = f"{BEST}-ba{record['batch']}"
    suffix = source.name[source.name.index(".") :] if "." in source.name else ""  # Composer reads it
    with atomic_path(folder / name, existing="swap") as tmp:
        tmp.mkdir()
        if source.is_dir():
            shutil.copytree(source, tmp / STEM, copy_function=_link_or_copy)
        else:
            _link_or_copy(str(source), str(tmp / f"{STEM}{suffix}"))
        (tmp / RECORD).write_text(json.dumps({**record, "checkpoint": source.name}, indent=1) + "\n")
    with atomic_path(folder / BEST) as tmp:
        tmp.symlink_to(name)
    for old in folder.glob(f"{BEST}-ba*"):  # earlier bests (ours: they hold a record)
        if old.name != name and old.is_dir() and not old.is_symlink() and (old / RECORD).exists():
            shutil.rmtree(old, ignore_errors=True)
    return folder / name


class KeepBest(Callback):
    """See the module docstring. `saver`: the Trainer's CheckpointSaver; `folder`: its local folder;
    `label`: the evaluator whose loss is judged ("holdout" or "eval"). Appended to the Trainer's
    callbacks after it is built, so that at a checkpoint event it runs after the saver."""

    def __init__(self, saver, folder: Path, label: str):
        self.saver, self.folder, self.label = saver, Path(folder), label
        self.best: dict | None = None
        self._pending: int | None = None  # the batch that beat the best, until its checkpoint is saved
        interval = saver.save_interval

        def save_interval(state: State, event: Event) -> bool:
            due = interval(state, event)  # called every time: Composer's schedule remembers its calls
            return due or (event in CHECKPOINT_EVENTS and self._pending == int(state.timestamp.batch))

        saver.save_interval = save_interval

    def fit_start(self, state: State, logger: Logger) -> None:
        # Rank 0 reads (other nodes may not see the folder); all ranks must decide alike.
        resumed = int(state.timestamp.batch) > 0
        box = [read_record(self.folder) if resumed and dist.get_global_rank() == 0 else None]
        dist.broadcast_object_list(box, src=0)
        self.best = box[0]
        if self.best is not None and dist.get_global_rank() == 0:
            log.info(
                "keep_best: the best so far is batch %d, %s %.6g (%s)",
                self.best["batch"], self.best["metric"], self.best["loss"], self.folder / BEST,
            )  # fmt: skip

    def eval_end(self, state: State, logger: Logger) -> None:
        if state.dataloader_label != self.label:
            return
        name = next((n for n in DEFAULT_METRICS if n in state.eval_metric_values), None)
        if name is None:
            raise ValueError(
                f"trainer.keep_best: the {self.label} evaluation measured none of {list(DEFAULT_METRICS)} "
                f"(it measured {sorted(state.eval_metric_values)})"
            )
        loss = float(state.eval_metric_values[name])  # reduced over the ranks: all decide alike
        if not math.isfinite(loss) or (self.best is not None and not loss < self.best["loss"]):
            return
        timestamp = state.timestamp
        self.best = {
            "batch": int(timestamp.batch),
            "sample": int(timestamp.sample),
            "loss": loss,
            "metric": f"metrics/{self.label}/{name}",
        }
        self._pending = int(timestamp.batch)
        # An evaluation at an epoch's or the fit's end comes after that batch's save: kept at once.
        self._keep_if_saved(state, logger)

    def batch_checkpoint(self, state: State, logger: Logger) -> None:
        self._keep_if_saved(state, logger)

    def epoch_checkpoint(self, state: State, logger: Logger) -> None:
        self._keep_if_saved(state, logger)

    def _keep_if_saved(self, state: State, logger: Logger) -> None:
        batch = int(state.timestamp.batch)
        saved = getattr(self.saver, "last_checkpoint_batch", None)
        if self._pending != batch or saved is None or int(saved) != batch:
            return
        self._pending = None
        logger.log_metrics({"keep_best/loss": self.best["loss"], "keep_best/batch": batch})
        if dist.get_global_rank() != 0 or not self.saver.saved_checkpoints:
            return
        source = Path(self.saver.saved_checkpoints[-1])
        if state.fsdp_sharded_state_dict_enabled:  # the saver lists a file inside the checkpoint's folder
            source = source.parent
        kept = keep(source, self.folder, self.best)
        log.info(
            "keep_best: batch %d is the best so far (%s %.6g): %s -> %s",
            batch, self.best["metric"], self.best["loss"], self.folder / BEST, kept.name,
        )  # fmt: skip

    def close(self, state: State, logger: Logger) -> None:
        if self._pending is not None and dist.get_global_rank() == 0:
            log.warning(
                "keep_best: the evaluation at batch %d was the best, but no checkpoint of that batch was "
                "saved, so %s still holds the previous best",
                self._pending, self.folder / BEST,
            )  # fmt: skip
