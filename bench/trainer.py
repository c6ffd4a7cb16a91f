"""Composer's step time against a plain PyTorch loop on the tiny UNet: what the Trainer costs.

    python bench/trainer.py [--steps 30] [--warmup 5] [--repeats 3] [--batch 16]

Every variant trains the same tiny StableDiffusion (random weights, seeded alike) with the tiny
recipe's AdamW on the same in-memory batches of precomputed latents (so data loading is out of the
picture), fp32 on the CPU, one thread:
  plain     for batch: loss = model.loss(model(batch), batch); backward; step; zero_grad
  composer  composer.Trainer with that model, optimizer and batches; no callbacks, loggers or saving
  recipe    the same Trainer with yamls/tiny-cpu.yaml's callbacks and algorithms (speed and LR
            monitors, NaN guard, EMA, the model record; not the sample grids, which sample on purpose)
Seconds per step are the median over `--steps` steps after `--warmup`, best of `--repeats` runs (the
machine is noisy). Prints a markdown table with each variant's ratio to the plain loop and exits
non-zero when composer / plain exceeds the goal, 1.10.
"""

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
from composer import Callback, Trainer  # noqa: E402
from hydra.utils import instantiate  # noqa: E402

GOAL = 1.10
VARIANTS = ("plain", "composer", "recipe")


def _setup(batch: int, steps: int):
    from models import build_model
    from recipes import load_config, parse_config

    run = parse_config(
        load_config(REPO / "yamls/tiny-cpu.yaml", ["model.pretrained=null", "~data.train.prepare"])
    )
    torch.manual_seed(0)
    model = build_model("tiny")
    optimizer = instantiate(run.optimizer, params=[p for p in model.parameters() if p.requires_grad])
    generator = torch.Generator().manual_seed(1)
    width = model.text_encoder.config.hidden_size
    batches = [
        {
            "latents": torch.randn(batch, 8, 8, 8, generator=generator),  # VAE moments (mean, logvar)
            "text_embeds": torch.randn(batch, 77, width, generator=generator),
        }
        for _ in range(steps)
    ]
    return run, model, optimizer, batches


class StepTimes(Callback):
    """Records the time at the end of every batch (bench/host_overhead.py uses it too)."""

    def __init__(self):
        self.times = []

    def batch_end(self, state, logger):
        self.times.append(time.perf_counter())


def median_step(times: list[float], warmup: int) -> float:
    return statistics.median(b - a for a, b in zip(times[warmup:], times[warmup + 1 :]))


def time_plain(batch: int, steps: int, warmup: int) -> float:
    _, model, optimizer, batches = _setup(batch, steps)
    model.train()
    times = []
    for data in batches:
        loss = model.loss(model(data), data)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        times.append(time.perf_counter())
    return median_step(times, warmup)


def time_composer(batch: int, steps: int, warmup: int, recipe: bool) -> float:
    from models.checkpoints.record import ModelRecord, describe

    run, model, optimizer, batches = _setup(batch, steps)
    timer = StepTimes()
    callbacks, algorithms = [timer], []
    if recipe:
        callbacks += [instantiate(spec) for name, spec in run.callbacks.items() if name != "samples"]
        callbacks.append(ModelRecord(describe(model)))
        algorithms = [instantiate(spec) for spec in run.algorithms.values()]
    trainer = Trainer(
        model=model,
        train_dataloader=batches,
        optimizers=optimizer,
        max_duration=f"{steps}ba",
        device="cpu",
        precision="fp32",
        callbacks=callbacks,
        algorithms=algorithms,
        loggers=[],
        progress_bar=False,
        log_to_console=False,
        save_folder=None,
        seed=0,
        device_train_microbatch_size=batch,
        train_subset_num_batches=steps,
    )
    trainer.fit()
    trainer.close()
    return median_step(timer.times, warmup)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batch", type=int, default=16)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    best = {v: float("inf") for v in VARIANTS}
    for _ in range(args.repeats):  # interleaved, so a slow spell of the machine hits every variant
        best["plain"] = min(best["plain"], time_plain(args.batch, args.steps, args.warmup))
        best["composer"] = min(best["composer"], time_composer(args.batch, args.steps, args.warmup, False))
        best["recipe"] = min(best["recipe"], time_composer(args.batch, args.steps, args.warmup, True))
    print(f"tiny UNet, batch {args.batch} of precomputed latents, fp32, 1 CPU thread; best of {args.repeats}")
    print("| variant | ms / step | / plain |")
    print("|---|---|---|")
    for variant in VARIANTS:
        print(f"| {variant} | {1000 * best[variant]:.1f} | {best[variant] / best['plain']:.3f} |")
    ratio = best["composer"] / best["plain"]
    print(f"composer / plain = {ratio:.3f} (goal <= {GOAL}): {'met' if ratio <= GOAL else 'MISSED'}")
    return 0 if ratio <= GOAL else 1


if __name__ == "__main__":
    sys.exit(main())
