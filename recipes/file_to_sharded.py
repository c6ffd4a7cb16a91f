"""A one-file checkpoint continued by a sharded run (FSDP2): written as a torch distributed checkpoint.

Composer 0.32.1 loads a sharded run only from a sharded checkpoint ("load_path must be a directory
when using sharded state dict"), so a run started on one process could not continue under
`composer -n N` of a recipe that shards there. The file holds what the sharded checkpoint holds, whole:
each node's local rank 0 reads it once (downloading a remote one first) and writes it as torch
distributed checkpoint (one process, no collectives) into a folder of the system's temp space, which
Composer then loads as it loads any sharded checkpoint, each rank taking its shards. The user's file
is only read. The EMA's average moves to where a sharded run keeps it (extensions/ema_sharded.py: the
EMAShards callback's state, the EMA's own state saying so): the inverse of
models/sharded_checkpoint.ema_from_shards.
"""

import atexit
import logging
import shutil
import tempfile
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from composer.utils import dist, maybe_create_object_store_from_uri, parse_uri

from models.checkpoints.sharded_checkpoint import EMA_SHARDS, SHARDED_EMA
from recipes.resume import is_remote

log = logging.getLogger(__name__)


def ema_to_shards(state: dict) -> dict:
    """`state` (a checkpoint file's) with the EMA's average where a sharded run keeps it. Before the
    EMA started the sharded run's average is a placeholder that its start overwrites: the model's
    tensors stand in for it (a superset: torch distributed checkpoint loads the names asked for)."""
    algorithms = state.get("algorithms") or []
    for i, (name, algorithm_state) in enumerate(algorithms):
        if name == "EMA" and isinstance(algorithm_state, dict) and algorithm_state.get("ema") != SHARDED_EMA:
            average = algorithm_state.get("ema") or dict(state["model"])
            algorithms[i] = (name, {**algorithm_state, "ema": SHARDED_EMA})
            state.setdefault("callbacks", {})[EMA_SHARDS] = {"ema": average}
    return state


def write_sharded(file: str | Path, folder: str | Path) -> None:
    """The checkpoint file at `file` as a torch distributed checkpoint in `folder`, on this process."""
    checkpoint = torch.load(file, map_location="cpu", weights_only=False)  # our own run's checkpoint
    checkpoint["state"] = ema_to_shards(checkpoint["state"])
    dcp.save(checkpoint, storage_writer=dcp.FileSystemWriter(str(folder)), no_dist=True)


def sharded_copy(load_path: str) -> str:
    """The folder every rank of this node loads `load_path` (a checkpoint file, local or remote) from:
    written once per node by its local rank 0, removed when that process exits."""
    folder = None
    if dist.get_local_rank() == 0:
        folder = tempfile.mkdtemp(prefix="sd-resume-")
        atexit.register(shutil.rmtree, folder, True)
        file = load_path
        if is_remote(load_path):
            file = str(Path(folder) / "download.pt")
            maybe_create_object_store_from_uri(load_path).download_object(parse_uri(load_path)[2], file)
        log.info("a sharded run loads the checkpoint file %s: writing it sharded in %s", load_path, folder)
        write_sharded(file, Path(folder) / "checkpoint")
        if file != load_path:
            Path(file).unlink()
        folder = str(Path(folder) / "checkpoint")
    folders = dist.all_gather_object(folder)
    return folders[dist.get_global_rank() - dist.get_local_rank()]
