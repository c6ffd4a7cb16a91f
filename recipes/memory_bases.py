"""The planner's memory of a LoRA run by `model.base_weights` (models/training/base_weights.py): the
run's own rows, then what each of its shapes needs with every other way to store the frozen base (null:
fp32 as loaded, bf16, and on a transformer fp8 and nf4), and the line that says which fit. Those other
rows are marked `alternative`: the run's own rows alone decide `fits` and the exit status. Only the
frozen column changes with it (recipes/footprint.py), and the activations are counted in bf16, which
a stored base computes in.
"""

import copy

from recipes.memory import gb, shape_memory

NO_BASE = object()  # a run with no choice of model.base_weights: the table has no such column
BASE_NAMES = {None: "fp32"}  # model.base_weights null: the base as loaded


def base_choices(run) -> list:
    """The model.base_weights values this run could take (none without model.lora): those
    check_base_weights accepts with the run's other settings."""
    from models.training.base_weights import BASE_WEIGHTS, check_base_weights

    model = run.model
    if model.get("lora") is None:
        return []
    choices = []
    for choice in (None, *BASE_WEIGHTS):
        try:
            check_base_weights(
                choice, model["preset"], model["lora"], model.get("param_dtype"), model.get("fp8")
            )
        except ValueError:
            continue
        choices.append(choice)
    return choices


def _with_base(run, choice):
    variant = copy.copy(run)
    variant.model = {**run.model, "base_weights": choice}
    return variant


def add_base_rows(run, row: dict, listed, gpu_memory: float) -> str:
    """Append to `row["memory"]` its shapes (`listed`: (shard, weights sharded)) with each other
    model.base_weights; return the line naming every choice's total and those that fit."""
    own = run.model.get("base_weights")
    totals = {}
    for choice in base_choices(run):
        for shard, shard_weights in listed:
            entry = shape_memory(
                _with_base(run, choice), row["gpus"], shard, row["microbatch"], shard_weights
            )
            fits = entry["total"] <= gpu_memory
            if choice != own:
                row["memory"].append({**entry, "base_weights": choice, "alternative": True, "fits": fits})
            totals.setdefault(choice, []).append((entry["total"], fits))
    sizes = ", ".join(f"{BASE_NAMES.get(c, c)} {'/'.join(gb(t) for t, _ in v)}" for c, v in totals.items())
    fit = [BASE_NAMES.get(c, c) for c, v in totals.items() if any(f for _, f in v)]
    return (
        f"at {row['gpus']} GPUs, by model.base_weights (how this LoRA run stores its frozen base; its own: "
        f"{BASE_NAMES.get(own, own)}): {sizes} GB; fit in {gpu_memory:g} GB: {', '.join(fit) or 'none'}"
    )


def smaller_bases(run, row: dict, own_shape: tuple[int, bool], gpu_memory: float) -> str | None:
    """The model.base_weights overrides with which the run's own shape fits in `gpu_memory` GB, with
    their totals ("model.base_weights=fp8 (21.8 GB), or ..."), or None."""
    counted = 1 if row["microbatch"] in (None, "auto") else row["microbatch"]
    fitting = []
    for choice in base_choices(run):
        if choice == run.model.get("base_weights"):
            continue
        entry = shape_memory(_with_base(run, choice), row["gpus"], own_shape[0], counted, own_shape[1])
        if entry["total"] <= gpu_memory:
            value = "null" if choice is None else choice
            fitting.append(f"model.base_weights={value} ({gb(entry['total'])} GB)")
    return ", or with ".join(fitting) or None
