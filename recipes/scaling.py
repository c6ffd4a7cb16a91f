"""Batch arithmetic: how one global batch splits over devices and microbatches.

The YAML fixes the global batch (the optimization hyperparameter) and the microbatch (what fits in
one device's memory); the per-device batch and the gradient accumulation steps follow from the
world size. A split that does not come out even is an error that names the numbers, never a silent
truncation: `global // world` on 3 devices would quietly train 2046 images a step instead of 2048.

Composer itself tolerates a microbatch that does not divide the per-device batch (the last
microbatch is smaller) or exceeds it (no split, with a warning on every batch); we refuse both so
that "gradient accumulation steps" is one number and every microbatch has the size that was tuned
for memory.
"""

from dataclasses import dataclass

from recipes.config import ConfigError

AUTO = "auto"  # Composer's adaptive microbatching (GPU only): halves the microbatch on OOM


@dataclass(frozen=True)
class BatchPlan:
    per_device_batch: int
    microbatch: int | str  # an int, or "auto"
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
    """Split `global_batch_size` over `world_size` devices and `microbatch`-sized forward passes.

    `microbatch` is `trainer.device_train_microbatch_size`: an int, "auto", or None (Composer then
    runs the whole per-device batch at once, so one microbatch per step).
    """
    per_device = per_device_batch_size(global_batch_size, world_size)
    if microbatch is None:
        return BatchPlan(per_device, per_device, 1)
    if microbatch == AUTO:
        return BatchPlan(per_device, AUTO, None)
    _check_positive_int("trainer.device_train_microbatch_size", microbatch, allow_auto=True)
    split = f"(global_train_batch_size={global_batch_size} / {world_size} devices)"
    if microbatch > per_device:
        raise ConfigError(
            f"trainer.device_train_microbatch_size={microbatch} is larger than the per-device batch "
            f"{per_device} {split}; set it to a divisor of {per_device} (e.g. "
            f"trainer.device_train_microbatch_size={per_device}) or to 'auto' on GPUs"
        )
    if per_device % microbatch:
        below = max(d for d in range(1, microbatch) if per_device % d == 0)
        raise ConfigError(
            f"trainer.device_train_microbatch_size={microbatch} does not divide the per-device batch "
            f"{per_device} {split}; the nearest smaller divisor is {below}"
        )
    return BatchPlan(per_device, microbatch, per_device // microbatch)


def _check_positive_int(name: str, value, allow_auto: bool = False) -> None:
    # bool is an int subclass; `True` as a batch size is a YAML slip, not 1.
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        expected = "a positive integer or 'auto'" if allow_auto else "a positive integer"
        raise ConfigError(f"{name} must be {expected}, got {value!r}")
