"""What gpu_check's rows share: Composer's peak for the GPU, which MFU is taken against (peak_flops),
a profile's headline numbers (add_profile), and the ceiling's row (plain_row, run 1's "plain" job:
bench/plain_loop.py's plain PyTorch loop over the recipe's model).
"""

import json
from pathlib import Path

from bench.gpu.gpu_runs import PLAIN
from bench.plain_loop import plain_loop
from bench.profile_summary import one_line


def plain_row(out: Path, batches: int, microbatch: int) -> dict:
    """The plain loop's row (sd2-base at 256 px, `batches` steps of `microbatch`), its profile in
    OUT/profile-plain-loop-256.json."""
    from models.flops import mfu, training_flops_per_image

    profile = out / "profile-plain-loop-256.json"
    img_s, peak = plain_loop("sd2-base", 256, microbatch, steps=batches, profile=profile, variant=PLAIN)
    flops = training_flops_per_image("sd2-base", 256)
    row = {"variant": PLAIN, "resolution": 256, "microbatch": microbatch, "ok": True, "img_s": img_s,
           "memory_gb": peak, "mfu": mfu(img_s, flops, peak_flops())}  # fmt: skip
    add_profile(row, profile)
    return row


def add_profile(row: dict, path: Path) -> None:
    """The profile's headline numbers into the row, and one line to the log."""
    if not path.exists():
        return
    summary = json.loads(path.read_text())
    row.update(
        profile=str(path),
        gpu_busy=summary["gpu_busy_fraction"],
        launches=summary["kernel_launches_per_step"] + summary["cuda_graph_launches_per_step"],
        syncs=summary["host_syncs_per_step"],
    )
    print(f"profile {row['variant']} at {row['resolution']} px: {one_line(summary)} -> {path}", flush=True)


def peak_flops() -> float:
    """Composer's bf16 peak for this GPU (SpeedMonitor's table), NaN for one it does not know."""
    import torch

    from compat.composer import GPU_AVAILABLE_FLOPS

    name = torch.cuda.get_device_name().lower()
    for chip in ("h200", "h100", "a100", "a10"):
        if chip in name:
            key = next(
                k for k in GPU_AVAILABLE_FLOPS if k.startswith(chip) and ("pcie" in k) == ("pcie" in name)
            )
            return GPU_AVAILABLE_FLOPS[key].get("bf16") or float("nan")
    return float("nan")
