"""Reading a Composer checkpoint file for export: its state, the raw weights and the EMA average.

Composer writes `{"state": {"model": ..., "algorithms": [(name, state), ...], "callbacks": {...}}}`;
the optimizer state (twice the UNet's size) is memory-mapped and never read.
"""

from pathlib import Path

import torch


def read_checkpoint(path: str | Path) -> dict:
    """The `state` of a Composer checkpoint file, its tensors memory-mapped (the optimizer state,
    twice the UNet's size, is never read)."""
    path = Path(path)
    if path.is_dir():
        raise IsADirectoryError(
            f"{path} is a folder: give one checkpoint file (sharded checkpoints are unsupported)"
        )
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint not found: {path}")
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=False, mmap=True)
    except RuntimeError:  # mmap needs the zip format torch.save writes by default; older files lack it
        checkpoint = torch.load(path, map_location="cpu", weights_only=False)
    state = checkpoint.get("state") if isinstance(checkpoint, dict) else None
    if not isinstance(state, dict) or "model" not in state:
        raise ValueError(f"{path} is not a Composer checkpoint (no state['model'] in it)")
    return state


def model_state(state: dict) -> dict[str, torch.Tensor]:
    # DDP adds "module."; the EMA algorithm strips it too, so both name tensors the same way.
    return {k.removeprefix("module."): v for k, v in state["model"].items()}


def ema_state(state: dict) -> dict[str, torch.Tensor] | None:
    """name -> averaged tensor of the EMA algorithm, or None when the checkpoint has no average
    (no EMA algorithm, or saved before its `ema_start`). Reads recipes.ema.EMA's state and
    composer.algorithms.EMA's; an EMA state of any other shape is an error, never the raw weights."""
    for name, algorithm_state in state.get("algorithms") or []:
        if name != "EMA":
            continue
        if "ema" in algorithm_state:  # recipes.ema.EMA
            return algorithm_state["ema"]
        if "ema_model" in algorithm_state:
            return _composer_ema(algorithm_state, state)[0]
        raise ValueError(
            f"the checkpoint's EMA state has keys {sorted(algorithm_state)}, which neither recipes.ema.EMA "
            "nor composer.algorithms.EMA writes; export the raw weights with --raw"
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
