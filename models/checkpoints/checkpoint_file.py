"""Reading a Composer checkpoint file for export: its state, the raw weights and the EMA average.

Composer writes `{"state": {"model": ..., "algorithms": [(name, state), ...], "callbacks": {...}}}`;
the optimizer state (twice the UNet's size) is memory-mapped and never read. A sharded checkpoint
(a folder, written under FSDP2) is read by models/checkpoints/sharded_checkpoint.py into the same `state`.
"""

import contextlib
import sys
import zipfile
from collections.abc import Iterator
from pathlib import Path

import torch

from models.checkpoints.sharded_checkpoint import (
    ShardedCheckpointError,
    check_complete,
    ema_from_shards,
    is_sharded_checkpoint,
    read_sharded_checkpoint,
)

# torch.save writes a zip archive; torch before 1.6 (and _use_new_zipfile_serialization=False) a
# pickle, protocol 2. A file that starts like neither is no checkpoint; a zip without its end record
# was cut short.
ZIP_MAGIC, PICKLE_MAGIC = b"PK\x03\x04", b"\x80"


class CheckpointError(ValueError):
    """What was asked of a checkpoint file cannot be done: it is truncated or not a Composer
    checkpoint, or lacks what a flag asks for (EMA weights, a LoRA adapter). The message is one line
    that says which and what to do; the CLIs print it instead of a traceback."""


@contextlib.contextmanager
def one_line_errors(prog: str, *more: type[Exception]) -> Iterator[None]:
    """A command's mistakes (a missing, truncated or foreign checkpoint, a flag it contradicts, and
    any of `more`) end `prog` with one `prog: error: ...` line and status 1, not a traceback. Every
    CLI that reads checkpoints (models.export and .generate, evaluation.evaluate, demo.judge) uses it."""
    try:
        yield
    except (CheckpointError, FileNotFoundError, IsADirectoryError, *more) as error:
        sys.exit(f"{prog}: error: {error}")


def check_checkpoint_file(path: str | Path) -> Path:
    """The checks of `path` that read a few bytes, not the checkpoint: it is a file in torch.save's
    format, and whole if a zip. A CLI makes them before its slow work; read_checkpoint again."""
    path = Path(path)
    if is_sharded_checkpoint(path):  # a sharded checkpoint's folder: complete, or one line why not
        try:
            check_complete(path)
        except ShardedCheckpointError as error:
            raise CheckpointError(str(error)) from error
        return path
    if path.is_dir():
        raise IsADirectoryError(folder_problem(path))
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint not found: {path}")
    with path.open("rb") as file:
        head = file.read(16)
    size = path.stat().st_size
    # is_zipfile reads only the end record: constant time on a checkpoint of any size.
    if not head or (head.startswith(ZIP_MAGIC) and not zipfile.is_zipfile(path)):
        what = "a zip archive without its end record" if head else "empty"
        raise CheckpointError(
            f"{path} is truncated ({size} bytes, {what}: a copy or save was cut short); copy it again "
            "or use an earlier checkpoint"
        )
    if not head.startswith((ZIP_MAGIC, PICKLE_MAGIC)):
        raise CheckpointError(
            f"{path} is not a Composer checkpoint: torch.save writes a zip archive, this file starts "
            f"with {head!r}"
        )
    return path


# What `models.export --lora` writes (diffusers' save_lora_weights' file name).
LORA_FILE = "pytorch_lora_weights.safetensors"


def folder_problem(path: Path) -> str:
    """Why the folder `path`, not a sharded checkpoint, is no checkpoint file either, in one line that
    names what it is (an exported pipeline, a LoRA adapter's folder) and what to give instead."""
    if (path / LORA_FILE).is_file():
        return (
            f"{path} holds a LoRA adapter ({LORA_FILE}), not a checkpoint or a pipeline: diffusers' "
            "load_lora_weights puts it on its base model; here give the LoRA run's checkpoint "
            "(models.export --merge-lora makes a full pipeline of it)"
        )
    if (path / "model_index.json").is_file():
        return (
            f"{path} is an exported pipeline folder already (model_index.json), not a training checkpoint: "
            "generate, evaluate and demo.judge read it as it is; a run starts from it with model.pretrained="
        )
    return (
        f"{path} is a folder but neither a sharded checkpoint (no .metadata or .distcp files) nor an "
        "exported pipeline (no model_index.json): give a checkpoint file or a sharded checkpoint's "
        "folder (ep{E}-ba{B}/)"
    )


def read_checkpoint(path: str | Path) -> dict:
    """The `state` of a Composer checkpoint file, its tensors memory-mapped (of the optimizer state,
    twice the UNet's size, only a bf16 run's fp32 master weights are ever read: `master_state`)."""
    path = check_checkpoint_file(path)
    if path.is_dir():
        return read_sharded_checkpoint(path)
    with path.open("rb") as file:
        # mmap needs the zip format; the pickle of torch before 1.6 is read whole.
        mmap = file.read(len(ZIP_MAGIC)) == ZIP_MAGIC
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=False, mmap=mmap)
    except (OSError, MemoryError):  # the disk or the machine, not the file's contents
        raise
    except Exception as error:
        # Unpickling what is not a checkpoint fails in any way at all (UnpicklingError "invalid load
        # key" or "Memo value not found", EOFError, the zip reader's RuntimeError, ...); a pickle may
        # also be one cut short, which nothing marks.
        reason = (str(error).strip().splitlines() or [type(error).__name__])[0]
        guess = "not a Composer checkpoint" if mmap else "not a Composer checkpoint, or is truncated"
        raise CheckpointError(f"{path} is {guess} (torch.load: {reason})") from error
    state = checkpoint.get("state") if isinstance(checkpoint, dict) else None
    if not isinstance(state, dict) or "model" not in state:
        raise CheckpointError(f"{path} is not a Composer checkpoint (no state['model'] in it)")
    return ema_from_shards(state)  # a sharded run's, converted to one file (dcp_to_torch_save)


def model_state(state: dict) -> dict[str, torch.Tensor]:
    # DDP adds "module."; the EMA algorithm strips it too, so both name tensors the same way.
    return {k.removeprefix("module."): v for k, v in state["model"].items()}


def master_state(state: dict) -> dict[str, torch.Tensor]:
    """name -> the fp32 master weight that extensions/master_weights.py's optimizer keeps for each
    bf16 parameter of a `model.param_dtype: bfloat16` run: the trained weight at full precision,
    where the model's own is that rounded to bf16. Empty for any other run."""
    masters = {}
    for optimizer in (state.get("optimizers") or {}).values():
        per_parameter = optimizer.get("state") if isinstance(optimizer, dict) else None
        for name, parameter_state in (per_parameter or {}).items():
            # Composer saves the state by parameter name (torch's optimizer state dict by index).
            if isinstance(name, str) and isinstance(parameter_state, dict) and "master" in parameter_state:
                masters[name.removeprefix("module.")] = parameter_state["master"]
    return masters


def ema_state(state: dict) -> dict[str, torch.Tensor] | None:
    """name -> averaged tensor of the EMA algorithm, or None when the checkpoint has no average
    (no EMA algorithm, or saved before its `ema_start`). Reads extensions.ema.EMA's state and
    composer.algorithms.EMA's; an EMA state of any other shape is an error, never the raw weights."""
    for name, algorithm_state in state.get("algorithms") or []:
        if name != "EMA":
            continue
        if "ema" in algorithm_state:  # extensions.ema.EMA
            return algorithm_state["ema"]
        if "ema_model" in algorithm_state:
            return _composer_ema(algorithm_state, state)[0]
        raise CheckpointError(
            f"the checkpoint's EMA state has keys {sorted(algorithm_state)}, which neither "
            "extensions.ema.EMA nor composer.algorithms.EMA writes; export the raw weights with --raw"
        )
    return None


def _composer_ema(algorithm_state: dict, state: dict) -> tuple[dict | None, dict | None]:
    """(average, raw trainable weights) of composer.algorithms.EMA, (None, None) before it started.

    Composer swaps the average into the model for every checkpoint it saves (`ema_weights_active`),
    so the model's tensors are then the average and its `ema_model` holds the raw weights."""
    if not algorithm_state.get("ema_started"):
        return None, None
    stored = {
        k.removeprefix("module."): v for k, v in algorithm_state["ema_model"]["named_parameters_dict"].items()
    }
    if not algorithm_state.get("ema_weights_active"):
        return stored, None
    weights = model_state(state)
    return {k: weights[k] for k in stored if k in weights}, stored


def raw_state(state: dict) -> dict[str, torch.Tensor]:
    """The raw training weights: the model's, except where composer.algorithms.EMA had swapped its
    average in for the save."""
    weights = model_state(state)
    for name, algorithm_state in state.get("algorithms") or []:
        if name == "EMA" and "ema_model" in algorithm_state:
            raw = _composer_ema(algorithm_state, state)[1]
            weights.update(raw or {})
    return weights
