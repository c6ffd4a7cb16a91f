"""The checkpoint a run loads (its `trainer.load_path`, or the one autoresume chose: recipes/resume.py),
checked against the run's model before anything trains.

Composer would load it once the Trainer is built and fail, for another preset's checkpoint, with a
state-dict traceback of a hundred size mismatches. Here rank 0 reads the checkpoint memory-mapped
(models/checkpoints/checkpoint_file.py: the tensors' shapes, not their data) and compares it with the model
the run built: a missing, truncated or foreign file, or a model whose tensors differ, is one config-error
line on every rank that names the file, the checkpoint's preset (models/checkpoints/record.py records it) and
the run's. Presets whose tensors are the same (sd2-base and sd2-768-v differ in sample size and objective
only) may load each other: that is how SD2's 768-v model was trained from the base one.
"""

import logging
from pathlib import Path

import torch
from composer.utils import format_name_with_dist

from models.checkpoints.checkpoint_file import CheckpointError, folder_problem, model_state, read_checkpoint
from models.checkpoints.record import read_record
from models.checkpoints.sharded_checkpoint import (
    ShardedCheckpointError,
    check_complete,
    is_sharded_checkpoint,
    read_sharded_checkpoint,
    tensor_shapes,
)
from recipes.config import ConfigError
from recipes.resume import ResumeError, autoresume, is_remote, on_rank_zero

log = logging.getLogger(__name__)


def resume_and_check(trainer: dict, preset: str, run_name: str) -> dict:
    """`trainer` (composer.Trainer's keyword arguments) with the checkpoint a rerun resumes from as its
    load_path (recipes/resume.py), that checkpoint or the run's own load_path checked against the
    model; a ConfigError, on every rank, when it cannot be loaded."""
    try:
        resumed = autoresume(trainer, run_name)
    except ResumeError as error:
        raise ConfigError(str(error)) from error
    chosen = resumed.get("load_path") != trainer.get("load_path")  # by autoresume, not the user
    check_load_path(resumed, preset, run_name, "autoresume's checkpoint" if chosen else "trainer.load_path")
    return resumed


def check_load_path(trainer: dict, preset: str, run_name: str, what: str = "trainer.load_path") -> None:
    """Raise ConfigError, on every rank, when `trainer["load_path"]` (composer.Trainer's keyword
    arguments) is a local checkpoint file or sharded checkpoint folder that the run's model cannot
    load. Remote paths and tar or compressed files are left to Composer."""
    path = trainer.get("load_path")
    if not path or is_remote(str(path)):
        return
    strict = trainer.get("load_strict_model_weights", True)
    path = format_name_with_dist(str(path), run_name)  # rank 0's file, as Composer loads
    problem = on_rank_zero(lambda: load_path_problem(path, trainer["model"], preset, strict, what))
    if problem is not None:
        raise ConfigError(problem)


def load_path_problem(
    path: str, model: torch.nn.Module, preset: str, strict: bool = True, what: str = "trainer.load_path"
) -> str | None:
    """Why `model` (of `preset`) cannot load the checkpoint file or sharded checkpoint folder at `path`,
    in one line that starts with `what` (the user's trainer.load_path, or autoresume's choice); None if
    it can."""
    if is_sharded_checkpoint(path):  # its metadata's shapes and its record: no tensor is read
        try:
            shapes = tensor_shapes(check_complete(path))
            state = read_sharded_checkpoint(path, parts=("callbacks",))
        except ShardedCheckpointError as error:
            return f"{what}: {error}"
        saved = {name: torch.empty(shape, device="meta") for name, shape in shapes.items()}
    elif Path(path).is_dir():
        return f"{what}: {folder_problem(Path(path))}"
    elif not path.endswith(".pt"):
        return None
    else:
        try:
            state = read_checkpoint(path)
        except (CheckpointError, FileNotFoundError) as error:
            return f"{what}: {error}"
        saved = model_state(state)
    recorded = (read_record(state) or {}).get("preset")
    differences = tensor_differences(saved, model.state_dict(), strict)
    if not differences:
        if recorded not in (None, preset):
            log.warning("loading %s, a %s checkpoint, into a %s model: same tensors", path, recorded, preset)
        return None
    held = f"a model of preset {recorded}" if recorded else "a model that records no preset"
    fix = f"set model.preset={recorded}, or " if recorded not in (None, preset) else ""
    return (
        f"{what}: {path} holds {held}, and this run's model.preset is {preset}: "
        f"{len(differences)} tensors differ ({differences[0]}); {fix}give a checkpoint of a {preset} model"
    )


def tensor_differences(saved: dict, wanted: dict, strict: bool = True) -> list[str]:
    """What keeps a model with the tensors `wanted` from loading `saved` (name -> tensor): shapes that
    differ, and with `strict` (Composer's load_strict_model_weights) names either lacks."""
    differences = [
        f"{name}: {list(saved[name].shape)} in the checkpoint, {list(wanted[name].shape)} in the model"
        for name in wanted
        if name in saved and saved[name].shape != wanted[name].shape
    ]
    if strict:
        differences += [f"{name} missing from the checkpoint" for name in wanted if name not in saved]
        differences += [f"{name} not in the model" for name in saved if name not in wanted]
    return differences
