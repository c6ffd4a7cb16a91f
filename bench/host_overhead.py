"""Host time of a training step of yamls/sd2-base.yaml: our Composer path against a plain loop.

    python bench/host_overhead.py [--steps 30] [--warmup 5] [--repeats 6] [--batch 2] [--no-compiled]

On an H100 the sd2-base UNet at 256 px is launch-bound: the host's time per step (Python, kernel
launches, hooks, syncs) exceeds the GPU's, so what our path adds on the host is what the GPU loses.
Measured here on the CPU with compute made negligible: a UNet with sd2-base's blocks (4 levels, 2
ResNet + 2 transformer blocks a level, linear projections, SDPA, the same op count) at widths
32/64/128/128 on 8x8 latents and 77x32 text embeddings (bench/narrow.py), batch 2, one thread.

  plain      a PyTorch loop with the recipe's options: Composer's low-precision norm modules, caption
             dropout, fused AdamW, the warmup schedule, clipping at 1.0; fp32, as Composer refuses
             amp_bf16 on the CPU (so bf16 autocast's weight casts, a GPU cost, are not measured here)
  ours       trainer_kwargs(yamls/sd2-base.yaml) as `composer train.py` builds it (its callbacks,
             algorithms, optimizer, model options and parallelism), on the CPU, with the same
             in-memory batches in place of the streaming loader (data loading runs in DataLoader
             workers on a GPU node, not on the training thread)
  ours-compiled  ours with model.compile_unet=true: inductor (C++ kernels on the CPU; no CUDA graphs
             here), static shapes; the compilation, in the first step, is inside the warm-up. The
             first run compiles for minutes; inductor's on-disk cache makes later ones take seconds
Composer's FSDP needs CUDA (composer/distributed/dist_strategy.py asks torch.cuda for the device),
so sd2-base's FSDP option (the override in its YAML) cannot be timed here through Composer; with
torch FSDP directly, on this model's block structure, it cost 1.4-1.8x a plain loop's host time
(../shared/docs/design.md, "The GPU path"). `make gpu-check` times the FSDP and DDP variants on a GPU.

Seconds per step: the median over `--steps` after `--warmup`, best of `--repeats` interleaved runs.
The last line is `host overhead: ours / plain = X (target <= 1.10)`; exits 1 when it is missed. The
line before it, `compiled / eager = X`, is ours-compiled / ours, with no target: on a CPU inductor
changes the kernels' compute as well, so it is not the host's share alone.
"""

import argparse
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
from composer import Trainer  # noqa: E402

from bench.narrow import PRESET, register_preset  # noqa: E402
from bench.trainer import StepTimes, median_step  # noqa: E402
from compat.composer import cache_fsdp_enabled, step_without_closure  # noqa: E402

TARGET = 1.10
VARIANTS = ("plain", "ours", "ours-compiled")


def recipe(*overrides: str):
    from recipes import load_config, parse_config

    base = [
        f"model.preset={PRESET}",
        "model.pretrained=null",
        "data.train.remote=/unused",  # the loader is replaced by in-memory batches
        "data.train.latents=true",
        "trainer.save_folder=null",
        "trainer.autoresume=false",
        "trainer.device=cpu",
        "trainer.precision=fp32",  # Composer refuses amp_bf16 on the CPU
        "_step=eager",  # the recipe's CUDA-graph step is GPU only; "ours-compiled" compiles itself
        "trainer.progress_bar=false",
        "trainer.log_to_console=false",
        "~loggers.wandb",
        "callbacks.samples=null",  # samples on purpose, every 5000 batches
    ]
    return parse_config(load_config(REPO / "yamls/sd2-base.yaml", [*base, *overrides]))


def batches(batch: int, count: int) -> list[dict]:
    generator = torch.Generator().manual_seed(1)
    return [
        {
            "latents": torch.randn(batch, 8, 8, 8, generator=generator),  # VAE moments (mean, logvar)
            "text_embeds": torch.randn(batch, 77, 32, generator=generator),
        }
        for _ in range(count)
    ]


def time_plain(batch: int, steps: int, warmup: int) -> float:
    from hydra.utils import instantiate

    from models import build

    run = recipe()
    torch.manual_seed(0)
    model = build(**run.model)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = instantiate(run.optimizer, params=params)
    warmup_batches = int(run.scheduler["t_warmup"].removesuffix("ba"))
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: min(1.0, (step + 1) / warmup_batches)
    )
    model.train()
    times = []
    for data in batches(batch, steps):
        loss = model.loss(model(data), data)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        times.append(time.perf_counter())
    return median_step(times, warmup)


def time_ours(batch: int, steps: int, warmup: int, *options: str) -> float:
    import recipes.trainer as trainer_module

    overrides = [f"global_train_batch_size={batch}", f"trainer.device_train_microbatch_size={batch}"]
    run = recipe(*overrides, f"trainer.max_duration={steps}ba", *options)
    loader = trainer_module.build_image_caption_dataloader
    trainer_module.build_image_caption_dataloader = lambda *args, **kwargs: batches(batch, steps)
    try:
        torch.manual_seed(0)
        kwargs = trainer_module.trainer_kwargs(run, world_size=1)
    finally:
        trainer_module.build_image_caption_dataloader = loader
    timer = StepTimes()
    kwargs["callbacks"].append(timer)
    trainer = Trainer(**kwargs, train_subset_num_batches=steps)
    cache_fsdp_enabled(trainer.state)  # as recipes.build_trainer does
    step_without_closure(trainer)  # likewise
    trainer.fit()
    trainer.close()
    return median_step(timer.times, warmup)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=6)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--no-compiled", action="store_true", help="leave out ours-compiled")
    args = parser.parse_args(argv)
    variants = VARIANTS[:2] if args.no_compiled else VARIANTS
    torch.set_num_threads(1)
    register_preset()
    timers = {
        "plain": lambda: time_plain(args.batch, args.steps, args.warmup),
        "ours": lambda: time_ours(args.batch, args.steps, args.warmup),
        "ours-compiled": lambda: time_ours(args.batch, args.steps, args.warmup, "model.compile_unet=true"),
    }
    best = dict.fromkeys(variants, float("inf"))
    for _ in range(args.repeats):  # interleaved, so a slow spell of the machine hits every variant
        for variant in variants:
            best[variant] = min(best[variant], timers[variant]())
    print(
        f"{PRESET} (sd2-base's UNet blocks, narrow), batch {args.batch} of 8x8 latents, fp32, "
        f"1 CPU thread; median of {args.steps - args.warmup - 1} steps, best of {args.repeats}"
    )
    print("| variant | ms / step | / plain |")
    print("|---|---|---|")
    for variant in variants:
        print(f"| {variant} | {1000 * best[variant]:.1f} | {best[variant] / best['plain']:.3f} |")
    if "ours-compiled" in best:
        print(f"compiled / eager = {best['ours-compiled'] / best['ours']:.3f}")
    ratio = best["ours"] / best["plain"]
    print(f"host overhead: ours / plain = {ratio:.3f} (target <= {TARGET:.2f})")
    return 0 if ratio <= TARGET else 1


if __name__ == "__main__":
    sys.exit(main())
