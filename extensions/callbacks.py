"""Callbacks the recipes use besides Composer's own."""

import contextlib
import json
import logging
import os
import random
from pathlib import Path

import numpy as np
import torch
from composer.core import Callback, State
from composer.loggers import Logger
from composer.utils import (
    checkpoint,
    dist,
    format_name_with_dist,
    format_name_with_dist_and_time,
    reproducibility,
)

from common.atomic import atomic_path
from compat.composer import take_loaded_rng_state
from models.checkpoints.sharded_checkpoint import ShardedCheckpointError, check_complete

log = logging.getLogger(__name__)


class NonFiniteLossError(RuntimeError):
    pass


class NaNGuard(Callback):
    """Stops training at the first NaN (or Inf) loss, naming the batch.

    Each microbatch's loss check stays on the device (no host sync); after the last microbatch's
    backward and before the optimizer step (Composer's AFTER_TRAIN_BATCH), one flag per batch is
    read, all-reduced across ranks when there are several (one small collective per batch; Composer
    itself does one more per batch for the sample count). So a non-finite loss never reaches the
    optimizer and the weights are still those of the last good batch: with `save_last_good`, they
    are saved (with optimizer, EMA, data position and RNG state) to
    `{save_folder}/last-good-ba{N}-rank{R}.pt` (sharded: the checkpoint folder `ep{E}-ba{N}/`, kept
    as it is when the interval checkpoint of that batch is there) before stopping, and the `latest`
    link points there, so rerunning the command resumes from it. A remote (s3://) save_folder keeps it
    in the local staging folder that the message names; it is not uploaded. `check_inf=False` stops
    on NaN only.
    """

    def __init__(self, check_inf: bool = True, save_last_good: bool = True):
        self.check_inf = check_inf
        self.save_last_good = save_last_good
        self._bad: torch.Tensor | None = None  # this batch's microbatches so far: any non-finite?

    def before_train_batch(self, state: State, logger: Logger) -> None:
        self._bad = None  # also when Composer retries a batch with smaller microbatches (auto)

    def after_loss(self, state: State, logger: Logger) -> None:
        losses = state.loss.values() if isinstance(state.loss, dict) else [state.loss]
        for loss in losses:
            if isinstance(loss, torch.Tensor):
                loss = loss.detach()
                bad = (~torch.isfinite(loss) if self.check_inf else torch.isnan(loss)).any()
                self._bad = bad if self._bad is None else self._bad | bad

    def after_train_batch(self, state: State, logger: Logger) -> None:
        flag = torch.zeros(1) if self._bad is None else self._bad.reshape(1).float()
        self._bad = None
        if dist.get_world_size() > 1:  # every rank must stop (and join the save) together
            flag = state.device.tensor_to_device(flag)
            dist.all_reduce(flag, reduce_operation="MAX")
        if not flag.item():
            return
        batch = int(state.timestamp.batch) + 1  # the batch being trained, 1-based like checkpoints
        where = ""
        saver = next((cb for cb in state.callbacks if type(cb).__name__ == "CheckpointSaver"), None)
        if self.save_last_good and saver is not None and "://" not in str(saver.folder):
            folder = Path(format_name_with_dist(saver.folder, state.run_name))
            saved = _save_last_good(state, saver, folder, batch - 1)
            if saved is not None:
                where = f"; the weights after batch {batch - 1} are saved in {saved}"
        message = f"loss is not finite at batch {batch}{where}"
        log.error(message)
        raise NonFiniteLossError(message)


def _save_last_good(state: State, saver, folder: Path, batch: int) -> Path | None:
    """Save the state after `batch` (the last good one) in `folder`; the checkpoint's path on the ranks
    that hold it (rank 0 without sharding), else None, and the `latest` link pointing at it.

    Sharded (FSDP2), Composer names the checkpoint's folder as the interval checkpoints' (`ep{E}-ba{B}`).
    When the interval checkpoint of this batch is there whole already, it is this state (but for the
    RNG, which it holds from before the bad batch's draws) and stays as it is: saving again would
    rewrite its shard files in place, and a kill meanwhile would tear a complete checkpoint."""
    if not state.fsdp_sharded_state_dict_enabled:
        path = checkpoint.save_checkpoint(state, str(folder / f"last-good-ba{batch}-rank{{rank}}.pt"))
        if path is not None:
            _point_latest_at(saver, state, Path(path))
        return None if path is None else Path(path)
    assert state.fsdp_config is not None  # sharded state dicts come with one
    prefix = str(folder / state.fsdp_config.sharded_ckpt_prefix_dir)
    target = Path(format_name_with_dist_and_time(prefix, state.run_name, state.timestamp))
    whole = torch.tensor([1.0 if _complete(target) else 0.0])
    if dist.get_world_size() > 1:  # every rank saves or none does (the save is a collective)
        whole = state.device.tensor_to_device(whole)
        dist.all_reduce(whole, reduce_operation="MIN")
    if not whole.item():
        checkpoint.save_checkpoint(state, str(folder / f"last-good-ba{batch}-rank{{rank}}.pt"))
    if dist.get_global_rank() == 0:
        _point_latest_at(saver, state, target)
    return target


def _complete(folder: Path) -> bool:
    try:
        check_complete(folder)
    except (ShardedCheckpointError, OSError):
        return False
    return True


def _point_latest_at(saver, state: State, path: Path) -> None:
    """Rerunning the command (autoresume) then resumes from the last good state, not from an older
    interval checkpoint. Replaced atomically: a kill here leaves the old link or the new one."""
    if saver.latest_filename is None:
        return
    latest = Path(saver.latest_filename.format(state))
    with atomic_path(latest) as tmp:
        tmp.symlink_to(os.path.relpath(path, latest.parent))


class LossLog(Callback):
    """Appends `{"batch": N, "loss": x, "total": y}` per batch to a JSON-lines file on rank 0 (for
    audits and the resume tests); a resumed run appends the batches it re-trains again. `loss`: rank
    0's last microbatch loss as Composer leaves it (scaled by its share of the rank's batch); `total`:
    the batch's loss over every rank and microbatch (Composer's `loss/train/total`), the number to
    compare between runs on different numbers of processes."""

    def __init__(self, path: str):
        self.path = Path(path)

    def batch_end(self, state: State, logger: Logger) -> None:
        if dist.get_global_rank() != 0:
            return
        loss = state.loss.item() if isinstance(state.loss, torch.Tensor) else float("nan")
        total = state.total_loss_dict.get("loss/train/total", float("nan"))
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a") as f:
            f.write(json.dumps({"batch": int(state.timestamp.batch), "loss": loss, "total": total}) + "\n")
            f.flush()


def read_loss_log(path: str | Path, key: str = "loss") -> dict[int, float]:
    """batch -> `key` ("loss" or "total": LossLog's), keeping the last record for batches that a
    resumed run trained again."""
    records = {}
    for line in Path(path).read_text().splitlines():
        if line.strip():
            row = json.loads(line)
            records[row["batch"]] = row[key]
    return dict(sorted(records.items()))


class RestoreRngOnResume(Callback):
    """Restores the checkpoint's RNG state when a run resumes mid-epoch on a StreamingDataset.

    Composer 0.32 restores RNG only when it spins the dataloader forward or resumes at an epoch
    boundary; when the dataset resumes itself (streaming's `load_state_dict`) mid-epoch, the state
    is loaded but never applied, so noise, timesteps and caption dropout differ from the
    uninterrupted run. It is applied here, once the first batch is fetched: creating the new
    dataloader iterator draws from the RNG (its base seed), which the uninterrupted run did at the
    epoch's start, before the checkpointed state; fetching itself draws nothing (see the
    dataset's deterministic flips). A checkpoint of an epoch's last batch resumes into an epoch with
    no batch left: the state is applied at that epoch's end instead, before the next epoch's
    iterator draws its seed, as it did in the uninterrupted run.
    """

    def __init__(self, trainer):
        self.trainer = trainer
        self.pending = None

    def fit_start(self, state: State, logger: Logger) -> None:
        resumed_mid_epoch = int(state.timestamp.batch_in_epoch) > 0 and "train" in state.dataset_resumption
        if resumed_mid_epoch and (loaded := take_loaded_rng_state(self.trainer)) is not None:
            self.pending = loaded

    def after_dataloader(self, state: State, logger: Logger) -> None:
        self._restore(f"at batch {int(state.timestamp.batch) + 1}")

    def epoch_end(self, state: State, logger: Logger) -> None:
        self._restore(f"at the end of epoch {int(state.timestamp.epoch)}")

    def _restore(self, when: str) -> None:
        if self.pending is not None:
            reproducibility.load_rng_state(self.pending)
            self.pending = None
            log.info("restored the checkpoint's RNG state %s", when)


class IsolateEvalRng(Callback):
    """Evaluation during training leaves the training's random numbers as they were.

    The model's validation draws come from its own seeded generators (`StableDiffusion.eval_forward`),
    but the evaluation loop still touches the global RNGs: each new eval dataloader iterator draws its
    base seed from torch's, and whatever else runs in it (a dataset, a callback) may draw too. Without
    this, a run with `eval_interval` would train on other noise, timesteps and caption dropout than the
    same run without. The python, numpy, torch and CUDA states are saved before the first evaluator
    (EVAL_BEFORE_ALL) and restored after the last (EVAL_AFTER_ALL), after every callback's EVAL_END;
    `trainer.eval()`, which runs no *_ALL event, is covered from EVAL_START to EVAL_END.
    """

    def __init__(self):
        self._saved = None
        self._around_all = False

    def eval_before_all(self, state: State, logger: Logger) -> None:
        self._saved, self._around_all = _rng_state(), True

    def eval_start(self, state: State, logger: Logger) -> None:
        if self._saved is None:
            self._saved = _rng_state()

    def eval_end(self, state: State, logger: Logger) -> None:
        if not self._around_all:
            self._restore()

    def eval_after_all(self, state: State, logger: Logger) -> None:
        self._restore()
        self._around_all = False

    def _restore(self) -> None:
        if self._saved is not None:
            _set_rng_state(self._saved)
            self._saved = None


def _rng_state():
    cuda_used = torch.cuda.is_available() and torch.cuda.is_initialized()
    cuda = torch.cuda.get_rng_state_all() if cuda_used else None
    return random.getstate(), np.random.get_state(), torch.random.get_rng_state(), cuda


@contextlib.contextmanager
def preserved_rng():
    """Whatever the block draws from the python, numpy, torch or CUDA RNGs, they are as before after it."""
    saved = _rng_state()
    try:
        yield
    finally:
        _set_rng_state(saved)


def _set_rng_state(saved) -> None:
    python, numpy_state, torch_state, cuda = saved
    random.setstate(python)
    np.random.set_state(numpy_state)
    torch.random.set_rng_state(torch_state)
    if cuda is not None:
        torch.cuda.set_rng_state_all(cuda)
