"""One training step as a plain PyTorch loop writes it: what Composer runs for this recipe each batch,
in one place to read top to bottom (nanoGPT's train.py and DiT's train.py show theirs the same way).

Composer adds around it: the time bookkeeping and checkpoints, the callbacks (NaN guard, speed and
memory monitors, sample grids), loggers, evaluation, and the process group and samplers of several
processes. The step itself is this; `tests/test_reference_step.py` checks that it gives the Composer
path's losses, weights and EMA average bit for bit, for a DDPM and a rectified-flow recipe, with bf16
weights, gradient clipping and two microbatches; `python bench/overhead.py ceiling` (bench/plain_loop.py)
times it against the Trainer.

Every family runs the same step; what differs is behind the model's own methods (its latent scaling,
its text condition, its denoiser call) and its objective (models/engine/objectives.py: DDPM or
rectified flow), both from models/families/<name>/.
"""

import contextlib

import torch

from models.engine.latent_diffusion import in_dtype
from models.engine.objectives import mse_per_sample


def train_step(
    model,
    batch: dict,
    optimizer,
    scheduler=None,
    ema=None,
    step: int = 0,
    microbatches: int = 1,
    seed: int = 0,
    precision: str = "fp32",
    clip_norm: float | None = None,
):
    """Train `model` on one global batch (this process's part of it) and return the loss (a tensor
    on the model's device, so a GPU step never waits for the host).

    The batch is split into `microbatches` equal parts whose gradients add up (each loss scaled by
    its share of the batch, as Composer does); the gradients' global norm is clipped to `clip_norm`
    (Composer's GradientClipping, clipping_type "norm"); then the optimizer and the learning-rate
    schedule step once, and the EMA (extensions/ema.py) averages the new weights. `precision`: the
    run's trainer.precision ("amp_bf16": bf16 autocast on a GPU, as Composer; Composer trains a CPU
    run in fp32). `step`: the number of batches trained before this one (the EMA starts and decays by
    batch count). A model that draws per sample (`model.train_draws: sample`) keys its draws by `seed`
    (the run's) and `step`, as extensions/sample_draws.py tells it under Composer.
    """
    if getattr(model, "train_draws", "rank") == "sample":
        model.draw_key = (seed, step)
    model.train()
    optimizer.zero_grad(set_to_none=True)
    size = len(next(iter(batch.values())))
    total = 0.0
    for part in _split(batch, microbatches):
        share = len(next(iter(part.values()))) / size
        with _autocast(precision, model):
            loss = diffusion_loss(model, part) * share  # the objective's mean over this part
        loss.backward()
        total = total + loss.detach()  # on the loss's device: no host sync
    if clip_norm is not None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=clip_norm)
    optimizer.step()
    if scheduler is not None:
        scheduler.step()
    if ema is not None:
        ema.step(step + 1)  # after the update, as at Composer's BATCH_END
    return total


def diffusion_loss(model, batch: dict) -> torch.Tensor:
    """The training loss of `model` (a LatentDiffusion) on `batch`, written out: what Composer's
    `model.loss(model(batch), batch)` computes. The random draws come in this order from the global
    RNG (Composer seeds it with the run's seed + the rank): the latent sample, caption dropout, the
    objective's noise and timesteps."""
    if getattr(model, "train_draws", "rank") == "sample":
        # Draws keyed per sample (models/engine/draw_keys.py): the same steps, each sample's draws
        # from a generator of its own.
        return model.loss(model(batch), batch)
    # Latents: the VAE posterior's (mean, logvar), precomputed by `sd-convert latents` or encoded
    # here from the images; a sample of it, scaled (and shifted) as the family's latents are.
    moments = batch["latents"] if "latents" in batch else model.vae_moments(batch["image"])
    image_size = (moments.shape[-2] * model.vae_scale_factor, moments.shape[-1] * model.vae_scale_factor)
    latents = model.sample_latents(moments)
    # The text condition: the family's encoders' outputs (or the stored ones), each sample's caption
    # replaced by the empty one with probability model.caption_drop_prob (classifier-free guidance).
    condition = model.condition(batch, True, image_size)
    # The objective's draws: noise and a timestep per sample (DDPM: uniform integer steps; flow: the
    # preset's density, e.g. logit-normal, shifted by resolution).
    draws = model.objective.draws(latents)
    # The noisy input, the denoiser's timestep input, the target (epsilon, v or the flow's velocity)
    # and the noise level the loss weighting reads.
    noisy, timesteps, target, level = model.objective.diffuse(latents, draws, image_size)
    dtype = model.denoiser_dtype  # bf16 weights (model.param_dtype) get bf16 inputs
    prediction = model.denoise(noisy.to(dtype), timesteps, in_dtype(condition, dtype))
    # The mean squared error per sample (in fp32), weighted by noise level where the objective says
    # (DDPM's min-SNR-gamma, the flow's loss_weighting), averaged over the batch.
    per_sample = mse_per_sample(prediction, target)
    weight = model.objective.weight(level)
    return per_sample.mean() if weight is None else (per_sample * weight).mean()


def _autocast(precision: str, model) -> contextlib.AbstractContextManager:
    """Composer's precision context: bf16 autocast for amp_bf16 on a GPU, nothing on a CPU or fp32."""
    device = next(model.parameters()).device
    if precision == "amp_bf16" and device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    if precision not in ("fp32", "amp_bf16"):
        raise ValueError(f"precision {precision!r}: the reference step writes out fp32 and amp_bf16")
    return contextlib.nullcontext()


def _split(batch: dict, parts: int) -> list[dict]:
    """`batch` cut along its first dimension into `parts` (tensors) or slices (lists)."""
    size = len(next(iter(batch.values())))
    if parts < 1 or size % parts:
        raise ValueError(f"a batch of {size} does not split into {parts} equal microbatches")
    step = size // parts
    return [{k: v[i : i + step] for k, v in batch.items()} for i in range(0, size, step)]
