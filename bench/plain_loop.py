"""The ceiling the training path is compared with: a plain PyTorch loop over the recipe's model
(plain_loop). `python bench/overhead.py ceiling` runs it alone; gpu-check's table has it as run 1's
"plain" row (bench/gpu/rows.py, plain_row).
"""

import time


def plain_loop(
    preset: str,
    resolution: int,
    batch: int,
    steps: int = 20,
    warmup: int = 5,
    device="cuda",
    profile=None,
    variant: str = "plain PyTorch loop",
):
    """(img/s, peak GB) of a plain PyTorch loop over the recipe's model, the ceiling the training
    path is compared with: recipes/reference_step.py's train_step (forward, loss, backward, fused
    AdamW), bf16 autocast on CUDA,
    on batches already on the device; no Composer, FSDP, callbacks or data loader. With `profile`
    (a path), 3 more steps are profiled and summarised there (bench/profile_summary.py), named `variant`."""
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
        train_step(model, data, optimizer, precision="amp_bf16")  # bf16 autocast on CUDA

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
        profile_summary.write(profile, window.summary(), variant=variant, resolution=resolution, batch=batch)
    model = optimizer = data = None  # free the GPU for the next variants (own processes)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return img_s, peak
