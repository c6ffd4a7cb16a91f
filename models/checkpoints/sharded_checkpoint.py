"""Sharded checkpoints (torch distributed checkpoint, written by Composer under FSDP2: one folder per
checkpoint, `ep{epoch}-ba{batch}/`, holding a `__{rank}_0.distcp` file per rank of the first model
copy and a `.metadata` file): whether one is complete, and its state read on one process with no
knowledge of the number of GPUs it was trained on.

torch writes `.metadata` last, under a temporary name renamed into place, once every rank has written
its file (torch/distributed/checkpoint/filesystem.py `finish`); the metadata names, for every tensor
piece and object, the file, offset and length that hold it. So a checkpoint is complete when its
`.metadata` reads and every file it names is there, at least as long as the bytes it needs from it:
a kill while ranks were writing leaves no `.metadata`, a file lost or cut short since shows here.

`read_sharded_checkpoint` gives what models/checkpoints/checkpoint_file.py's `read_checkpoint` gives for a
file: `{"model": {name: tensor}, "algorithms": [(name, state)], "callbacks": {...}}`, whole tensors on the
CPU, the optimizer state left unread. The EMA's average, which a sharded run saves in the state of
the `EMAShards` callback (extensions/ema_sharded.py says why), is put back in the EMA's state, where a
checkpoint file has it.
"""

import warnings
from pathlib import Path

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint import load as dcp_load
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

METADATA = ".metadata"
# extensions/ema_sharded.py: the EMA's `ema` under FSDP2, and the callback whose state holds the average.
SHARDED_EMA, EMA_SHARDS = "sharded: in callbacks.EMAShards", "EMAShards"
# The parts of a Composer checkpoint's `state` that export, generate and evaluate read.
READ = ("model", "algorithms", "callbacks")


class ShardedCheckpointError(ValueError):
    """A sharded checkpoint folder that is incomplete or not one (models/checkpoints/checkpoint_file.py's
    CheckpointError subclasses nothing of this; callers map it)."""


def is_sharded_checkpoint(path: str | Path) -> bool:
    """A folder as Composer writes a sharded checkpoint: it has the `.metadata` or a `.distcp` file."""
    path = Path(path)
    return path.is_dir() and ((path / METADATA).exists() or any(path.glob("*.distcp")))


def read_metadata(path: str | Path) -> Metadata:
    """The checkpoint's metadata; ShardedCheckpointError when it is missing or does not read."""
    path = Path(path)
    if not (path / METADATA).is_file():
        raise ShardedCheckpointError(
            f"{path} is an incomplete sharded checkpoint: no {METADATA} (torch writes it last, once every "
            "rank has written its shard; the save was cut short)"
        )
    try:
        return FileSystemReader(str(path)).read_metadata()
    except Exception as error:  # noqa: BLE001 - an unpickling error of any kind: not whole
        raise ShardedCheckpointError(
            f"{path}/{METADATA} does not read ({type(error).__name__}: {error})"
        ) from error


def needed_bytes(metadata: Metadata) -> dict[str, int]:
    """file name -> how many bytes of it the metadata reads (the end of its last piece)."""
    needed: dict[str, int] = {}
    for info in metadata.storage_data.values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    return needed


def shard_problem(metadata: Metadata, sizes: dict[str, int]) -> str | None:
    """Why the files with these sizes (name -> bytes) do not hold the checkpoint; None when they do."""
    for name, need in sorted(needed_bytes(metadata).items()):
        if name not in sizes:
            return f"{name} is missing"
        if sizes[name] < need:
            return f"{name} is cut short ({sizes[name]} of at least {need} bytes)"
    return None


def check_complete(path: str | Path) -> Metadata:
    """The metadata of the complete sharded checkpoint at `path`; ShardedCheckpointError, one line, if it
    is not complete."""
    path = Path(path)
    metadata = read_metadata(path)
    sizes = {p.name: p.stat().st_size for p in path.iterdir() if p.is_file()}
    problem = shard_problem(metadata, sizes)
    if problem is not None:
        raise ShardedCheckpointError(f"{path} is an incomplete sharded checkpoint: {problem}")
    return metadata


def tensor_shapes(metadata: Metadata, part: str = "model") -> dict[str, torch.Size]:
    """name -> whole shape of every tensor under `state.<part>` (the model's, by default)."""
    shapes = {}
    for fqn, item in metadata.state_dict_metadata.items():
        path = metadata.planner_data.get(fqn, ())
        if isinstance(item, TensorStorageMetadata) and tuple(path[:2]) == ("state", part) and len(path) == 3:
            shapes[path[2]] = item.size
    return shapes


def read_sharded_checkpoint(path: str | Path, parts=READ) -> dict:
    """The `state` of the complete sharded checkpoint at `path` (only `parts` of it), whole tensors on
    the CPU, as one process reads it: no process group, whatever the number of ranks that wrote it."""
    metadata = check_complete(path)
    wanted = {
        fqn: item
        for fqn, item in metadata.state_dict_metadata.items()
        if tuple(metadata.planner_data[fqn][:2]) in {("state", part) for part in parts}
    }
    # A flat template, keyed as the checkpoint's own flattened names: tensors to read into, and objects
    # (None), which the load replaces with the stored value.
    flat = {
        fqn: torch.empty(item.size, dtype=item.properties.dtype)
        if isinstance(item, TensorStorageMetadata)
        else None
        for fqn, item in wanted.items()
    }
    with warnings.catch_warnings():  # "torch.distributed is disabled ...": one process is the point
        warnings.simplefilter("ignore", UserWarning)
        dcp_load(flat, storage_reader=FileSystemReader(str(path)), no_dist=True)
    state: dict = {}
    for fqn, value in flat.items():
        _set(state, metadata.planner_data[fqn][1:], value)
    return ema_from_shards(state)


def ema_from_shards(state: dict) -> dict:
    """`state` with a sharded run's EMA average (the EMAShards callback's) put back in the EMA's own
    state, where a checkpoint file has it (None before the EMA started: the average is a placeholder).
    Also for such a checkpoint converted to one file (torch's `dcp_to_torch_save`)."""
    for name, algorithm_state in state.get("algorithms") or []:
        if name == "EMA" and isinstance(algorithm_state, dict) and algorithm_state.get("ema") == SHARDED_EMA:
            started = algorithm_state.get("start_batch") is not None
            average = (state.get("callbacks") or {}).get(EMA_SHARDS, {}).get("ema")
            algorithm_state["ema"] = average if started else None
    return state


def _set(root: dict, path: tuple, value) -> None:
    """Put `value` at `path` in `root`, making dicts (str keys) and lists (int keys: a list or tuple
    in the saved state, such as `algorithms`' (name, state) pairs) on the way."""
    node = root
    for key, below in zip(path[:-1], path[1:]):
        child = node.get(key) if isinstance(node, dict) else (node[key] if key < len(node) else None)
        if child is None:
            child = [] if isinstance(below, int) else {}
            _put(node, key, child)
        node = child
    _put(node, path[-1], value)


def _put(node: dict | list, key, value) -> None:
    if isinstance(node, list):
        node.extend([None] * (key + 1 - len(node)))
    node[key] = value
