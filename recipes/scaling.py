"""Batch arithmetic: how one global batch splits over devices and microbatches.

The YAML fixes the global batch (the optimization hyperparameter) and a microbatch cap (what fits
in one device's memory); the per-device batch, the microbatch used and the gradient accumulation
steps follow from the world size. A global batch the world size does not divide is an error that
names the numbers, never a silent truncation: `global // world` on 3 devices would quietly train
2046 images a step instead of 2048.

`trainer.device_train_microbatch_size` is a cap, not an exact size: the microbatch used is the
largest divisor of the per-device batch not above it, so one recipe runs unchanged from 8 GPUs
(2048 / 8 = 256 per device, microbatches of 32) to 256 (8 per device, one microbatch of 8). A
divisor, so that every microbatch has the same size and "gradient accumulation steps" is one
number (Composer itself would run a smaller last microbatch, or no split with a warning on every
batch when the microbatch exceeds the per-device batch).
"""

from dataclasses import dataclass

from recipes.config import ConfigError

AUTO = "auto"  # Composer's adaptive microbatching (GPU only): halves the microbatch on OOM


@dataclass(frozen=True)
class BatchPlan:
    per_device_batch: int
    microbatch: int | str  # the microbatch used: an int, or "auto"
    grad_accum: int | None  # microbatches per device per step; None when the microbatch is "auto"


def per_device_batch_size(global_batch_size: int, world_size: int) -> int:
    """global / world size, refusing a split that would silently change the global batch."""
    _check_positive_int("global_train_batch_size", global_batch_size)
    _check_positive_int("world size", world_size)
    if global_batch_size % world_size:
        raise ConfigError(
            f"global_train_batch_size={global_batch_size} is not divisible by the world size "
            f"{world_size}; choose a global batch that is a multiple of the number of devices"
        )
    return global_batch_size // world_size


def plan_batches(global_batch_size: int, world_size: int, microbatch: int | str | None) -> BatchPlan:
    """Split `global_batch_size` over `world_size` devices and microbatches of at most `microbatch`.

    `microbatch` is `trainer.device_train_microbatch_size`: an int (a cap: the largest divisor of
    the per-device batch not above it is used), "auto", or None (Composer then runs the whole
    per-device batch at once, so one microbatch per step).
    """
    per_device = per_device_batch_size(global_batch_size, world_size)
    if microbatch is None:
        return BatchPlan(per_device, per_device, 1)
    if microbatch == AUTO:
        return BatchPlan(per_device, AUTO, None)
    _check_positive_int("trainer.device_train_microbatch_size", microbatch, allow_auto=True)
    used = max(d for d in range(1, min(microbatch, per_device) + 1) if per_device % d == 0)
    return BatchPlan(per_device, used, per_device // used)


def _check_positive_int(name: str, value, allow_auto: bool = False) -> None:
    # bool is an int subclass; `True` as a batch size is a YAML slip, not 1.
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        expected = "a positive integer or 'auto'" if allow_auto else "a positive integer"
        raise ConfigError(f"{name} must be {expected}, got {value!r}")
