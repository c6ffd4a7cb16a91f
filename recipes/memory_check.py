"""Before the model is built: the planner's estimate of a device's memory (recipes/memory.py) against
the memory the device has, so that a run that cannot fit says so in one line instead of growing until
the out-of-memory killer ends it (flux-dev on a 24 GB host grew ~0.9 GB/s for a minute, issue 47) or
CUDA's out-of-memory error at the first step.

The memory there: on a GPU, what `torch.cuda.mem_get_info` reports free on this process's device; on a
CPU run, the host's available memory (/proc/meminfo MemAvailable) shared by the node's processes.
The estimate counts weights, gradients, optimizer state, the EMA, frozen networks and the activations
of a microbatch, 4-7% above measured peaks (recipes/memory.py), so a run the check refuses is one
that would not have fitted with less than that to spare; `SD_MEMORY_CHECK=off` skips it.

Tracing a step for the activations takes 1-12 s (recipes/footprint.py), so it is done only where the
parameters alone, at 2 bytes each, fill a quarter of the memory: never for the tiny recipes.
"""

import logging
import os

import torch

from models.registry import PRESETS
from recipes.config import ConfigError

log = logging.getLogger(__name__)
GATE = 0.25  # the share of the memory the parameters' floor must reach before the full estimate is made


def available_bytes(device: str | None) -> tuple[int, str]:
    """(bytes this process may use, the memory in words) on the run's `device`."""
    if device != "cpu" and torch.cuda.is_available():
        index = int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count()
        free, total = torch.cuda.mem_get_info(index)
        name = torch.cuda.get_device_name(index)
        return free, f"GPU {index} ({name}) has {free / 1e9:.1f} of {total / 1e9:.1f} GB free"
    processes = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    available = host_available()
    share = f", shared by {processes} processes" if processes > 1 else ""
    return available // processes, f"this host has {available / 1e9:.1f} GB of memory available{share}"


def host_available() -> int:
    """MemAvailable of /proc/meminfo in bytes (the kernel's estimate of what can be used without
    swapping); the physical memory where there is no such file."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def parameter_floor(preset: str, shard: int) -> int:
    """Bytes no run of `preset` sharded over `shard` can do with less: every parameter at 2 bytes, the
    denoiser's divided by the shard (its networks built on the meta device: no memory, ~0.1 s)."""
    from models.flops import _meta_components
    from models.presets import denoiser_name

    parts = _meta_components(preset)
    count = {
        name: sum(p.numel() for p in part.parameters())
        for name, part in parts.items()
        if isinstance(part, torch.nn.Module)
    }
    denoiser = count.pop(denoiser_name(preset))
    return 2 * (denoiser // shard + sum(count.values()))


def check_memory(run, world_size: int, shard: int, plan) -> None:
    """ConfigError (one line: the estimate, the memory there and a change that would fit) when the run's
    estimate per device exceeds what this device has (`plan`: recipes/scaling.py's BatchPlan)."""
    if os.environ.get("SD_MEMORY_CHECK", "").lower() == "off":
        return
    preset = run.model["preset"]
    if preset not in PRESETS:  # an autoencoder's (models/autoencoder.py): the planner does not price them
        return
    have, where = available_bytes(run.trainer.get("device"))
    if parameter_floor(preset, shard) < GATE * have:
        return
    from recipes.memory import DEFAULT_GPUS_PER_NODE, shape_memory
    from recipes.memory_advice import suggest

    row = shape_memory(run, world_size, shard, plan.microbatch)
    if row["total"] * 1e9 <= have:
        log.info("memory: about %.1f GB per device of which %s", row["total"], where.split(" has ")[-1])
        return
    parts = ", ".join(
        f"{k} {row[k]:.1f}" for k in ("weights", "gradients", "optimizer", "ema", "frozen", "activations")
    )
    asked = {"gpus": world_size, "microbatch": plan.microbatch, "per_device_batch": plan.per_device_batch}
    cpu = run.trainer.get("device") == "cpu" or not torch.cuda.is_available()
    node = int(os.environ.get("LOCAL_WORLD_SIZE", 1 if cpu else DEFAULT_GPUS_PER_NODE))
    advice = suggest(run, asked, round(have / 1e9, 1), node, cpu)
    raise ConfigError(
        f"model.preset={preset} needs about {row['total']:.1f} GB per device ({parts} GB; shard {shard}, "
        f"microbatch {row['microbatch']}; python -m recipes.plan), and {where}: {advice} "
        "(SD_MEMORY_CHECK=off skips this check)"
    )
