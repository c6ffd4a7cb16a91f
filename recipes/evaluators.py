"""A run's held-out validation (`data.train.holdout`) and best checkpoint (`trainer.keep_best`).

- The held-out samples (data/holdout.py) are evaluated as Composer's evaluator `holdout`, at the
  trainer's `eval_interval` and `eval_subset_num_batches` like any other, on the EMA weights when the
  run has an EMA, and logged as `metrics/holdout/<metric>`.
- Judged at fixed timesteps as the Flux recipe is (models/engine/eval_timesteps.py): a holdout sets
  `model.eval_timesteps` to MLPerf's 8 when the run leaves it unset, so the metric is
  `metrics/holdout/FixedTimestepLoss`. The option is the model's, so a `data.eval` of the same run is
  judged at the same timesteps (its FixedTimestepLoss is logged too). An autoencoder has no timesteps:
  its holdout logs MeanSquaredError.
- With `data.eval` too, both are evaluated, the holdout first: each is logged under its own label
  (`metrics/holdout/...`, `metrics/eval/...`), and what a callback reads from Composer's last values
  (the quality target) is data.eval's, as without a holdout.
- `trainer.keep_best` (extensions/keep_best.py) judges the holdout, or data.eval without one. It is
  the recipe's key, not composer.Trainer's: `trainer_options` takes it out.
"""

import inspect
import logging
from pathlib import Path

import torch
from composer.callbacks import CheckpointSaver
from composer.core import Evaluator
from composer.utils import format_name_with_dist

from data.loader import build_holdout_dataloader
from extensions.keep_best import KeepBest
from models.engine.eval_timesteps import STORED_LEVELS

log = logging.getLogger(__name__)

HOLDOUT = "holdout"  # the evaluator's label, and so its metrics' `metrics/holdout/...`
RECIPE_TRAINER_KEYS = ("keep_best",)  # under `trainer:` in a YAML, read by the recipe, not Composer


def with_fixed_timesteps(model: dict, holdout) -> dict:
    """`model` (run.model) with `eval_timesteps: 8` when a holdout is to be judged and the run leaves
    it unset, for a model that has the option (not an autoencoder)."""
    from models import MODELS

    if holdout is None or model.get("eval_timesteps") is not None:
        return model
    if "eval_timesteps" not in inspect.signature(MODELS[model["preset"]]).parameters:
        return model
    log.info("data.train.holdout is judged at model.eval_timesteps=%d (MLPerf's Flux rule)", STORED_LEVELS)
    return {**model, "eval_timesteps": STORED_LEVELS}


def trainer_options(trainer: dict) -> dict:
    """`run.trainer` without the recipe's own keys, for composer.Trainer."""
    return {k: v for k, v in trainer.items() if k not in RECIPE_TRAINER_KEYS}


def eval_dataloaders(run, train_loader, eval_loader, seed: int):
    """composer.Trainer's `eval_dataloader`: data.eval's loader alone, as before, or with a holdout the
    evaluators `holdout` then `eval` (the last one's values are Composer's `eval_metric_values`)."""
    if run.data.train.holdout is None:
        return eval_loader
    holdout = build_holdout_dataloader(train_loader, run.data.train)
    # Its own generator for its iterators' seeds, like data.eval's (recipes/trainer.py says why).
    holdout.generator = torch.Generator().manual_seed(seed)
    evaluators = [Evaluator(label=HOLDOUT, dataloader=holdout)]
    if eval_loader is not None:
        evaluators.append(Evaluator(label="eval", dataloader=eval_loader))
    return evaluators


def attach_keep_best(trainer, run) -> KeepBest | None:
    """With `trainer.keep_best`, a KeepBest on the built Trainer, after its CheckpointSaver."""
    if not run.trainer.get("keep_best"):
        return None
    saver = next(c for c in trainer.state.callbacks if isinstance(c, CheckpointSaver))
    folder = Path(format_name_with_dist(str(run.trainer["save_folder"]), run.run_name))
    keep_best = KeepBest(saver, folder, HOLDOUT if run.data.train.holdout is not None else "eval")
    trainer.state.callbacks.append(keep_best)
    return keep_best
