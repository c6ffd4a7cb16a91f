"""The ceiling bench/gpu_check.py compares the training path with: a plain PyTorch loop over the
recipe's model (plain_loop), and its row in gpu_check's table (plain_row, run 1's "plain" job); with
the two helpers that row shares with gpu_check's throughput rows: Composer's peak for the GPU, which
MFU is taken against (peak_flops), and a profile's headline numbers (add_profile).
"""

import json
import time
from pathlib import Path

from bench.gpu_runs import PLAIN
from bench.profile_summary import one_line


def plain_loop(
    preset: str, resolution: int, batch: int, steps: int = 20, warmup: int = 5, device="cuda", profile=None
):
    """(img/s, peak GB) of a plain PyTorch loop over the recipe's model, the ceiling the training
    path is compared with: recipes/reference_step.py's train_step (forward, loss, backward, fused
    AdamW), bf16 autocast on CUDA,
    on batches already on the device; no Composer, FSDP, callbacks or data loader. With `profile`
    (a path), 3 more steps are profiled and summarised there (bench/profile_summary.py)."""
    import torch

    from bench import profile_summary
    from models import build_model
    from models.flops import latent_size
    from models.stored_form import stored_shapes
    from recipes.reference_step import train_step

    device = torch.device(device)
    torch.manual_seed(0)
    model = build_model(preset).to(device)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5, fused=True)
    size = latent_size(preset, resolution)
    # The VAE's mean and log-variance, as convert latents writes them, for the UNet or transformer, and
    # the stored text condition of the preset's family (models/stored_form.py: its conditioner's own
    # columns and shapes, e.g. SD2's CLIP context, SDXL's and SD3's pooled vector, Flux's T5 context).
    moments = 2 * model.vae.config.latent_channels  # the VAE's channels: Flux packs 2x2 of them per token
    data = {"latents": torch.randn(batch, moments, size, size, device=device)}
    data.update(
        {name: torch.randn(batch, *shape, device=device) for name, shape in stored_shapes(preset).items()}
    )

    def step():  # the recipe's step as a plain loop writes it (recipes/reference_step.py), no EMA
        with torch.autocast(device.type, torch.bfloat16, enabled=device.type == "cuda"):
            train_step(model, data, optimizer)

    for _ in range(warmup):
        step()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    img_s = batch * steps / (time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated() / 1e9 if device.type == "cuda" else None
    if profile:  # after the timed steps: the profiler slows the host
        window = profile_summary.StepProfile(3)
        window.start()
        for _ in range(3):
            step()
        window.stop()
        profile_summary.write(profile, window.summary(), variant=PLAIN, resolution=resolution, batch=batch)
    model = optimizer = data = None  # free the GPU for the next variants (own processes)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return img_s, peak


def plain_row(out: Path, batches: int, microbatch: int) -> dict:
    """The plain loop's row (sd2-base at 256 px, `batches` steps of `microbatch`), its profile in
    OUT/profile-plain-loop-256.json."""
    from models.flops import mfu, training_flops_per_image

    profile = out / "profile-plain-loop-256.json"
    img_s, peak = plain_loop("sd2-base", 256, microbatch, steps=batches, profile=profile)
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
