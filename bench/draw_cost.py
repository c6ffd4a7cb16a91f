"""What `model.train_draws: sample` (models/engine/draw_keys.py) costs against the default `rank` draws, per
microbatch, for a preset's latents: the latent sample, caption dropout and the objective's draws, made
as models/engine/latent_diffusion.py makes them in training, and nothing else (no network).

    .venv/bin/python bench/draw_cost.py --preset sd2-base --resolution 256 --batch 32 [--device cuda]

`rank` draws on the device from the global RNG (a few kernels); `sample` hashes each sample's key and
draws from one CPU generator per sample, then copies the draws to the device. On a GPU the host time is
what matters (the GPU waits only if the host falls behind): compare the printed host ms per microbatch
with the step's GPU time for that microbatch (bench/throughput.py). Best of --repeat, each the mean of
--iters microbatches (the machine is noisy).
"""

import argparse
import time

import torch
from diffusers import DDPMScheduler, FlowMatchEulerDiscreteScheduler

from compat.diffusers import DiagonalGaussianDistribution
from models.engine.draw_keys import draw_seeds
from models.engine.objectives import DDPM, RectifiedFlow
from models.flops import latent_size
from models.registry import PRESETS, of


def objective_of(preset: str):
    """The family's kind of objective (models/registry.py `objective`), with its usual scheduler."""
    if of(preset).objective == "ddpm":
        return DDPM(DDPMScheduler(num_train_timesteps=1000))
    return RectifiedFlow(FlowMatchEulerDiscreteScheduler(shift=3.0))


def rank_draws(objective, moments, drop_prob):
    latents = DiagonalGaussianDistribution(moments).sample()
    drop = torch.rand(moments.shape[0], device=moments.device) < drop_prob
    return latents, drop, objective.draws(latents)


def sample_draws(objective, moments, drop_prob, batch_index, indices):
    seeds, uniforms = draw_seeds(0, batch_index, indices)
    posterior = DiagonalGaussianDistribution(moments)
    draws = objective.seeded_draws(seeds, posterior.mean.shape[1:], moments.device)
    latents = posterior.mean + posterior.std * draws["latent"]
    drop = torch.tensor(uniforms, device=moments.device) < drop_prob
    return latents, drop, draws


def best_ms(fn, iters: int, repeat: int, device) -> float:
    times = []
    for r in range(repeat):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        for i in range(iters):
            fn(r * iters + i)
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append((time.perf_counter() - start) / iters * 1e3)
    return min(times)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="sd2-base", choices=sorted(PRESETS))
    parser.add_argument("--resolution", type=int, default=256)
    parser.add_argument("--batch", type=int, default=32, help="samples per microbatch")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args(argv)

    device = torch.device(args.device)
    side = latent_size(args.preset, args.resolution)
    channels = PRESETS[args.preset]["vae"]["latent_channels"]
    moments = torch.randn(args.batch, 2 * channels, side, side, device=device)
    objective = objective_of(args.preset)
    rank = best_ms(lambda i: rank_draws(objective, moments, 0.1), args.iters, args.repeat, device)
    keyed = best_ms(
        lambda i: sample_draws(objective, moments, 0.1, i, list(range(i * args.batch, (i + 1) * args.batch))),
        args.iters,
        args.repeat,
        device,
    )
    print(
        f"{args.preset} at {args.resolution} px, {args.batch} x {channels}x{side}x{side} latents on {device} "
        f"(torch {torch.__version__}, {torch.get_num_threads()} threads): rank draws {rank:.3f} ms, "
        f"sample draws {keyed:.3f} ms per microbatch ({keyed / args.batch * 1e3:.1f} us a sample), "
        f"{keyed / rank:.1f}x"
    )


if __name__ == "__main__":
    main()
