"""Callbacks that tests add to a real training run (with `+callbacks.NAME={_target_: tests.probes.X}`;
a subprocess needs PYTHONPATH=REPO so that `tests` imports).

They observe or break a run from inside, at an exact point: the samples each global batch holds, a
NaN at batch k, a SIGKILL halfway through writing a checkpoint file.
"""

import io
import json
import os
import signal
import time
from pathlib import Path

import torch
from composer.core import Callback, State
from composer.loggers import Logger
from composer.utils import dist

from data.image_caption import ImageCaptionDataset


def _with_key(getitem):
    def getitem_with_key(self, index):
        sample = getitem(self, index)
        # The MDS row's own name for the sample (convert writes `key`), read again: the training
        # dataset drops it because the model does not need it.
        sample["key"] = super(ImageCaptionDataset, self).__getitem__(index)["key"]
        return sample

    getitem_with_key._with_key = True
    getitem_with_key.__wrapped__ = getitem
    return getitem_with_key


class KeyLog(Callback):
    """Appends `{"batch": N, "keys": [...]}` per global batch on rank 0: every rank's sample keys,
    all-gathered, rank 0's first.

    Constructing it makes ImageCaptionDataset batches carry each sample's MDS `key` (a class-level
    patch, so it also reaches the dataset the trainer has already built; DataLoader fetches samples
    through the class). The end of the run takes the patch back, so that a later in-process run of
    the same test worker gets the dataset's own samples.
    """

    def __init__(self, path: str):
        self.path = Path(path)
        if not getattr(ImageCaptionDataset.__getitem__, "_with_key", False):
            ImageCaptionDataset.__getitem__ = _with_key(ImageCaptionDataset.__getitem__)

    def fit_end(self, state: State, logger: Logger) -> None:
        getitem = ImageCaptionDataset.__getitem__
        if getattr(getitem, "_with_key", False):
            ImageCaptionDataset.__getitem__ = getitem.__wrapped__

    def post_close(self) -> None:
        self.fit_end(None, None)

    def after_dataloader(self, state: State, logger: Logger) -> None:
        keys = [k for rank_keys in dist.all_gather_object(list(state.batch["key"])) for k in rank_keys]
        if dist.get_global_rank() == 0:
            with self.path.open("a") as f:
                f.write(json.dumps({"batch": int(state.timestamp.batch) + 1, "keys": keys}) + "\n")


def read_key_log(path: str | Path) -> dict[int, list[str]]:
    rows = (json.loads(line) for line in Path(path).read_text().splitlines() if line.strip())
    return {row["batch"]: row["keys"] for row in rows}


class ShapeLog(Callback):
    """Appends `{"batch": N, "shape": [...]}` per batch on rank 0: the shape of its images."""

    def __init__(self, path: str):
        self.path = Path(path)

    def after_dataloader(self, state: State, logger: Logger) -> None:
        if dist.get_global_rank() == 0:
            with self.path.open("a") as f:
                shape = list(state.batch["image"].shape)
                f.write(json.dumps({"batch": int(state.timestamp.batch) + 1, "shape": shape}) + "\n")


class PoisonBatch(Callback):
    """Fills batch `batch`'s images with `value` (NaN by default), so its loss is not finite; with
    `rank`, on that rank only."""

    def __init__(self, batch: int, value: float = float("nan"), rank: int | None = None):
        self.batch, self.value, self.rank = batch, value, rank

    def after_dataloader(self, state: State, logger: Logger) -> None:
        if self.rank is not None and dist.get_global_rank() != self.rank:
            return
        if int(state.timestamp.batch) + 1 == self.batch:
            image = state.batch["image"]  # uint8 from the data loader cannot hold a NaN: floats instead
            state.batch["image"] = torch.full(image.shape, self.value, device=image.device)


class KillDuringSave(Callback):
    """SIGKILLs this process halfway through writing the checkpoint of batch `batch`: the file on
    disk then holds the first half of the real checkpoint's bytes, as after a kill or a node loss."""

    def __init__(self, batch: int):
        self.batch = batch

    def batch_end(self, state: State, logger: Logger) -> None:
        if int(state.timestamp.batch) != self.batch:
            return
        real_save = torch.save

        def torn_save(obj, f, *args, **kwargs):  # composer writes a checkpoint with torch.save(obj, f)
            if not (isinstance(obj, dict) and "state" in obj):  # torch.distributed pickling (the RNG gather)
                return real_save(obj, f, *args, **kwargs)
            buffer = io.BytesIO()
            real_save(obj, buffer, *args, **kwargs)
            data = buffer.getvalue()
            f.write(data[: len(data) // 2])
            f.flush()
            os.fsync(f.fileno())
            os.kill(os.getpid(), signal.SIGKILL)

        torch.save = torn_save  # the next save is this batch's checkpoint (BATCH_CHECKPOINT follows)


class AwaitRemoteCheckpoint(Callback):
    """Holds training before batch `batch` until the checkpoint of batch `batch - 1` is in the remote
    save_folder (the object itself, not Composer's `latest` pointer), so a kill once `batch` is logged
    finds that checkpoint or a newer one in the bucket. Uploads are asynchronous; the first waits for
    Composer's upload processes to start, longer than a tiny run's batches take."""

    def __init__(self, batch: int, timeout: float = 300.0):
        self.batch, self.timeout = batch, timeout

    def after_dataloader(self, state: State, logger: Logger) -> None:
        if int(state.timestamp.batch) + 1 != self.batch:
            return
        saver = next(cb for cb in state.callbacks if getattr(cb, "remote_uploader", None) is not None)
        folder = os.path.dirname(saver.remote_file_name.format(state).lstrip("/"))
        want = [f"-ba{self.batch - 1}-rank0.pt"]
        if state.fsdp_sharded_state_dict_enabled:  # a folder: its metadata and every rank's file
            sharded = f"-ba{self.batch - 1}/"
            want = [
                f"{sharded}.metadata",
                *(f"{sharded}__{r}_0.distcp" for r in range(dist.get_world_size())),
            ]
        deadline = time.monotonic() + self.timeout
        while time.monotonic() < deadline:
            saver.batch_end(state, logger)  # where Composer collects finished uploads
            names = saver.remote_uploader.remote_backend.list_objects(folder)
            if all(any(n.endswith(w) for n in names) for w in want):
                return
            time.sleep(0.1)
        raise TimeoutError(f"the checkpoint of batch {self.batch - 1} did not reach {folder}")


class KillBeforeLatest(Callback):
    """SIGKILLs this process once the checkpoint of batch `batch` is in place and Composer has removed
    the `latest` symlink to point it anew (composer/callbacks/checkpoint_saver.py deletes, then links):
    the folder then has the new checkpoint and no `latest`, which Composer's own autoresume read as
    "no checkpoint" and restarted at batch 0."""

    def __init__(self, batch: int):
        self.batch = batch

    def batch_end(self, state: State, logger: Logger) -> None:
        if int(state.timestamp.batch) != self.batch or dist.get_global_rank() != 0:
            return

        def killed_symlink(*args, **kwargs):
            os.kill(os.getpid(), signal.SIGKILL)

        os.symlink = killed_symlink  # the next symlink is this batch's `latest` (BATCH_CHECKPOINT follows)
