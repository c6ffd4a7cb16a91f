"""Samples to converge: how many training samples a run needs to reach its quality target, from MLPerf
Training's reference convergence points (RCPs), which `python -m recipes.plan` prices a run from.

MLPerf publishes, per benchmark and global batch, the samples to the target of 20 reference runs and
the hyper-parameters they trained with (github.com/mlcommons/logging, mlperf_logging/rcp_checker/);
its RCP checker takes the olympic mean of each batch's runs (the fastest and the slowest left out:
rcp_checker.py `compute_rcp_stats`) and interpolates linearly between batch sizes (`_create_interp_rcp`,
np.interp). The planner uses the same mean and the same interpolation between the measured batch
sizes (not the checker's pruned set, which keeps only the points that bound how fast a submission
may converge: the planner wants what a run is expected to need). A global batch outside the points
has no reference: MLPerf extrapolates none, and neither does the planner.

A run is priced this way when it trains to the benchmark's target: the preset, resolution, fixed
validation timesteps and `callbacks.quality_target.target` of `yamls/flux-schnell-mlperf.yaml`.
Its `trainer.max_duration` is then only a cap.
"""

from dataclasses import dataclass

import numpy as np

from extensions.quality_target import TARGET
from recipes.config import ConfigError


@dataclass(frozen=True)
class ReferencePoint:
    """The reference runs at one global batch: their hyper-parameters and samples to converge."""

    global_batch: int
    lr: float  # opt_base_learning_rate
    warmup_steps: int  # opt_learning_rate_warmup_steps (linear from 0, then constant)
    samples: tuple[int, ...]  # samples to converge, one per reference run

    @property
    def mean(self) -> float:
        """The RCP checker's mean: of the runs less the fastest and the slowest."""
        return float(np.mean(sorted(self.samples)[1:-1]))


@dataclass(frozen=True)
class Benchmark:
    name: str
    source: str
    preset: str
    resolution: int
    eval_timesteps: int
    target: float  # the validation loss that ends a run
    eval_every: int  # training samples between validations
    eval_samples: int  # validation samples per validation
    points: tuple[ReferencePoint, ...]  # by global batch
    shared: dict  # the reference runs' other settings, by run-config key (`run_settings`)

    def samples_to_converge(self, global_batch: int) -> int:
        """The expected samples to the target at `global_batch`: a point's mean, or the line between
        the two points around it; ConfigError outside them."""
        batches = [p.global_batch for p in self.points]
        if not batches[0] <= global_batch <= batches[-1]:
            raise ConfigError(
                f"global batch {global_batch} is outside the {self.name} reference runs' "
                f"{batches[0]}..{batches[-1]} ({self.source}): no samples to converge to price it at"
            )
        return round(float(np.interp(global_batch, batches, [p.mean for p in self.points])))

    def point(self, global_batch: int) -> ReferencePoint | None:
        return next((p for p in self.points if p.global_batch == global_batch), None)

    def settings(self, global_batch: int) -> dict | None:
        """The reference runs' settings at `global_batch` by run-config key; None between points."""
        point = self.point(global_batch)
        if point is None:
            return None
        return {"optimizer.lr": point.lr, "scheduler.t_warmup": f"{point.warmup_steps}ba", **self.shared}


# MLPerf Training v6.0's Flux.1 RCPs (training_6.0.0/rcps_flux1.json, "Reference RCPs before v6.0",
# 8xDGX-B200, BF16), AdamW betas 0.9 / 0.95, eps 1e-8, weight decay 0.1, clipping 1.0 in every entry.
# The target and the validation: mlcommons/training text_to_image/README.md ("Quality target",
# "Evaluation frequency", "Evaluation thoroughness").
# fmt: off
FLUX1 = Benchmark(
    name="MLPerf Flux.1",
    source="mlcommons/logging rcp_checker/training_6.0.0/rcps_flux1.json",
    preset="flux-schnell",
    resolution=256,
    eval_timesteps=8,
    target=0.586,
    eval_every=262_144,
    eval_samples=29_696,
    points=(
        ReferencePoint(512, 2.0e-4, 1600, (
            7077888, 7340032, 7077888, 7077888, 7340032, 7340032, 7602176, 7340032, 7077888, 7340032,
            7077888, 7340032, 7340032, 7077888, 7077888, 7077888, 7340032, 7340032, 7077888, 7340032,
        )),
        ReferencePoint(1024, 2.5e-4, 800, (
            8650752, 8650752, 8126464, 8650752, 8650752, 8912896, 8126464, 8388608, 8650752, 8126464,
            8126464, 8650752, 8388608, 8388608, 8650752, 8388608, 8388608, 8388608, 8912896, 8650752,
        )),
        ReferencePoint(2048, 2.5e-4, 0, (
            9437184, 10223616, 10485760, 11010048, 10747904, 12320768, 10485760, 9961472, 10485760, 9437184,
            9699328, 11534336, 9699328, 9699328, 10747904, 9961472, 10485760, 10747904, 9961472, 9961472,
        )),
        ReferencePoint(4096, 4.0e-4, 100, (
            15204352, 15990784, 15466496, 15728640, 15204352, 15466496, 15990784, 15204352, 14942208,
            15204352, 15466496, 16252928, 14680064, 14942208, 13893632, 15466496, 15466496, 15728640,
            15466496, 15204352,
        )),
    ),
    shared={
        "optimizer.betas": [0.9, 0.95],  # opt_adamw_beta_1, opt_adamw_beta_2
        "optimizer.eps": 1e-8,  # opt_adamw_epsilon
        "optimizer.weight_decay": 0.1,  # opt_adamw_weight_decay
        "algorithms.gradient_clipping.clipping_threshold": 1.0,  # opt_gradient_clip_norm
    },
)
# fmt: on
BENCHMARKS = (FLUX1,)


def quality_target(run) -> float | None:
    """The run's `callbacks.*.target` of the quality target callback, or None."""
    for spec in run.callbacks.values():
        if spec and spec.get("_target_") == TARGET and spec.get("target") is not None:
            return float(spec["target"])
    return None


def benchmark_of(run) -> Benchmark | None:
    """The benchmark whose target `run` trains to (its preset, resolution, validation and target), or
    None: the run is then priced by its max_duration."""
    for bench in BENCHMARKS:
        if (
            run.model.get("preset") == bench.preset
            and run.data.train.resolution == bench.resolution
            and run.model.get("eval_timesteps") == bench.eval_timesteps
            and quality_target(run) == bench.target
        ):
            return bench
    return None


def no_benchmark() -> str:
    """What a run lacks to be priced from samples to converge, for an error line."""
    return "no MLPerf target: " + "; ".join(
        f"{b.name}'s is model.preset {b.preset}, data.train.resolution {b.resolution}, model.eval_timesteps "
        f"{b.eval_timesteps} and callbacks.quality_target.target {b.target:g}"
        for b in BENCHMARKS
    )


def converging_rows(bench: Benchmark, plan_rows, global_batches: dict[int, int], microbatch, rate, price):
    """recipes.plan's rows for GPU count -> global batch `global_batches`, each priced at that batch's
    samples to converge (`plan_rows`: recipes.plan's, passed in to keep the import one way); a batch
    without a reference is that row's error."""
    rows = []
    for gpus, batch in global_batches.items():
        try:
            samples = bench.samples_to_converge(batch)
        except ConfigError as err:
            (row,) = plan_rows(batch, "0sp", microbatch, [gpus], rate, price)
            row.update(images=None, days=None, gpu_hours=None, cost=None, error=str(err))
        else:
            (row,) = plan_rows(batch, f"{samples}sp", microbatch, [gpus], rate, price)
        rows.append(row)
    return rows


def describe(bench: Benchmark, run, rows: list[dict], global_batches: list[int]) -> list[str]:
    """The lines above the table: where the samples come from, the time to train per count (what MLPerf
    scores), what is left out, and a note for each batch it trains at whose reference runs' settings
    (learning rate, warmup, AdamW's, clipping) are not the run's."""
    times = ", ".join(
        f"{row['gpus']} GPUs {_hours(row['days'])}" for row in rows if row.get("days") is not None
    )
    lines = [
        f"images: samples to reach {bench.name}'s target {bench.target:g} ({bench.source}: the olympic mean "
        f"of 20 reference runs per global batch, linear between batches); trainer.max_duration "
        f"{run.trainer.get('max_duration')} is only a cap",
        f"time to train (hours:minutes): {times or '-'}",
    ]
    mine = run_settings(run)
    for batch in sorted(set(global_batches)):
        theirs = bench.settings(batch) or {}
        differ = [key for key in theirs if mine.get(key) != theirs[key]]
        if differ:
            lines.append(
                f"note: at global batch {batch} the reference runs trained with "
                + " ".join(f"{key}={theirs[key]}" for key in differ)
                + ", this run with "
                + " ".join(f"{key}={mine.get(key)}" for key in differ)
                + ": it may need other samples"
            )
    lines.append(
        f"not counted: a validation of {bench.eval_samples:,} samples (forward only) every "
        f"{bench.eval_every:,} training samples, and the time to save checkpoints"
    )
    return lines


def _hours(days: float) -> str:
    minutes = round(days * 24 * 60)
    return f"{minutes // 60}:{minutes % 60:02d}"


def run_settings(run) -> dict:
    """The run's values of the keys a benchmark's `settings` hold (a warmup as `Nba`, 0ba without one)."""
    optimizer = run.optimizer
    clipping = [
        a for a in run.algorithms.values() if a and str(a.get("_target_")).endswith("GradientClipping")
    ]
    warmup = str((run.scheduler or {}).get("t_warmup", "0ba")).replace(" ", "")
    return {
        "optimizer.lr": optimizer.get("lr"),
        "scheduler.t_warmup": warmup,
        "optimizer.betas": list(optimizer.get("betas") or []),
        "optimizer.eps": optimizer.get("eps"),
        "optimizer.weight_decay": optimizer.get("weight_decay"),
        "algorithms.gradient_clipping.clipping_threshold": clipping[0].get("clipping_threshold")
        if clipping
        else None,
    }
