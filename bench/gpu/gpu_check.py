"""`make gpu-check`: the GPU path of yamls/sd2-base.yaml, measured and checked, in runs that each fit
one device call of at most 10 minutes (a GPU machine is lent rarely, for 15 minutes in all).

    python bench/gpu/gpu_check.py [--run 1..7] [--budget 520] [--out runs/gpu-check]
    python bench/gpu/gpu_check.py [--parts throughput e2e ema] [--variants TEXT ...] [--resolutions 256 512]
                              [--quick] [--deterministic] [--preset sd2-base|sdxl-base|sd3-medium]
    python bench/gpu/gpu_check.py --preset flux-schnell    # `make gpu-check PRESET=flux-schnell`, ~2 min

RUNS (bench/gpu/gpu_runs.py; `make gpu-check` is run 1, `make gpu-check PART=2` run 2, ...), each job in
its own process (a `composer -n GPUS` per variant), in order, cheapest and most certain first, with its
estimated seconds on one H100 (ESTIMATE_S), within a budget of 520 s (a device call's 600 s less
installing the carried wheels, the preflight and packing the results). The recipe's step is FULL
(yamls/_step/compiled.yaml); the baseline is the eager step (`_step=eager`), the plain loop's peer.
  1. How far is each step from the ceiling at 256 px? (~335 s): the eager step (90), the plain loop
     (30), the recipe's step: compile + CUDA graphs + bf16 weights + channels_last (215). Ran on
     2026-11-26: 198.4, 280.4 and 361.8 img/s.
  2. Does sd2-base.yaml, compiled, train, save, resume bitwise, export and generate on the GPU?
     (~515 s): e2e with --deterministic (330 s measured eager on 2026-11-24, plus two compiles).
  3. Does it win at 512 px as well? (~305 s): the eager step at 512 px (90), then run 1's best 256 px
     variant (read from OUT/gpu-check-run1.json; without it the recipe's step) at 512 px (215). Ran
     on 2026-11-26: 85.9 and 107.6 img/s.
  4-7. What each part of the step buys, and whether CUDA graphs hold with gradient accumulation (the
     recipe accumulates on 8-32 GPUs): 4 (~395 s): bf16 weights (90), FSDP per block (90), the
     recipe's step with 2 microbatches a batch (215); 5 (~305 s): 2x microbatch (90), compile + CUDA
     graphs (215); 6 (~260 s): the EMA's storage variants (45), compile; 7 (~430 s): compile +
     channels_last (215), the recipe's step with per-sample training draws (215; against run 1's
     361.8 img/s). No two compiled variants fit one run but run 7's (a guess: the same shapes, so
     inductor's cache may serve the second).
A variant's process took 90 s at 256 px and 75 s at 512 px on 2026-11-26 (python and imports,
building sd2-base's UNet, VAE and text encoder, the data loader, 25 batches); compiling the recipe's
step added 113-124 s (inductor's cache, /tmp/torchinductor_$USER, is shared by the processes but
misses across dtypes and memory formats). A lent machine's 15 minutes hold two runs: on 2026-11-26
runs 1 and 3 took 353 s and 298 s, the machine's start ~30 s.

A killed run still leaves what it measured: a job starts only while 75% of its estimate is left of
`--budget` (seconds from this script's start; 0: no limit), is killed (its whole process group) past
twice its estimate or the budget's end (the plain loop and the EMA check run in this process, without
a limit), and after every job OUT/gpu-check-runN.md (the table) and .json (rows, checks, seconds per
job against its estimate, what was skipped and why) are rewritten.

throughput: bench/throughput.py on sd2-base, bf16, precomputed latents (random; made here once per
size, `latents`: the largest batch per GPU of the preset's variants times the 5 warm-up, 20 timed and
3 profiled batches and one more, so no variant's batches cross an epoch's end; sd2-base on one GPU:
1,856 at 256 px, ~310 MB, ~3 s to make; 928 at 512 px, ~200 MB): img/s per GPU, MFU (models/flops.py
against Composer's peak for the GPU), peak memory; then a torch.profiler summary of 3 more batches
(bench/profile_summary.py) to OUT/profile-VARIANT-PX.json: GPU-busy fraction, kernel launches and
host syncs per step, top 10 kernels; one line per variant in the log; its result and log in
OUT/tp-PX-K.json and .log (K: the next number free of both). The best per size goes to
OUT/throughput-256.json / -512.json, which `recipes.plan --throughput-file` reads, unless the file
holds a faster one of the same recipe on the same device (an earlier run's: runs 1 and 4-7 all time
256 px).
plain: bench/plain_loop.py (the recipe's model in a bare PyTorch loop on 1 GPU: the ceiling; its row:
bench/gpu/rows.py).
depth (`--preset flux-schnell`, its only job): bench/gpu/depth_extrapolation.py, the 11.9 B transformer at
full width and reduced depth on one GPU (FLUX_DEPTHS), extrapolated per block to the full model's step
time, img/s and MFU (against torchtitan's 26.1%), and its unsharded peak memory; its record in
OUT/depth-flux-schnell-256px.json, and as the best, OUT/throughput-flux-schnell-256.json for recipes.plan.
e2e: bench/gpu/gpu_e2e.py (train, save, resume, export, generate; bitwise with --deterministic).
ema: the EMA's storage variants (fp32 on the GPU, bf16, CPU offload) give the same average.
--variants, --parts, --resolutions or --quick, and the other presets (`--preset sdxl-base`: its
SDXL_VARIANTS at 512 and 1024 px; `sd3-medium`: SD3_VARIANTS at 256 and 512), select the jobs
instead of a run: the variants at the lower size, the baseline and the best at the higher, the
plain loop last. Prints a markdown table with the anchors' ratios; exits non-zero if a check fails.
Without CUDA it exits at once with one line. Needs no network: the weights are random.
"""

import argparse
import json
import re
import sys
import time
from pathlib import Path

START = time.monotonic()  # --budget counts from here: before torch's import, CUDA's start and gpus()
REPO = Path(__file__).resolve().parents[2]
sys.path[0] = str(REPO)  # not bench/gpu/: `bench.gpu.*`, `models`, ... import from the repo

from bench.gpu.depth_extrapolation import depth_row  # noqa: E402
from bench.gpu.gpu_e2e import DATA  # noqa: E402 (after the path fix)
from bench.gpu.gpu_runs import (  # noqa: E402
    BASE,
    BUDGET_S,
    COMPILED_STEP,
    FULL,
    FULL_2,
    PER_SAMPLE,
    RUNS,
    composer,
    custom_jobs,
    run_and_report,
)
from bench.gpu.rows import add_profile, peak_flops, plain_row  # noqa: E402

ANCHORS = {  # img/s per GPU to reach, and where the number comes from
    256: (440.0, "MosaicML's 23.8% MFU on A100 carried to H100"),
    512: (124.0, "NVIDIA's MLPerf Training v4.1 SD per H100"),
}
MICROBATCH = {256: 32, 512: 16}
WARMUP, PROFILE_STEPS = 5, 3  # batches before the timed ones, and profiled after them
MARKERS = ("MICROBATCH_X2", "TWO_MICROBATCHES")  # in a variant: its microbatch doubled; 2 a batch
# The step without compile, CUDA graphs, bf16 weights or channels-last: the baseline each switch is
# timed against (yamls/_step/eager.yaml); the recipe's own step is FULL (yamls/_step/compiled.yaml).
EAGER = "_step=eager"
# The UNet sharded per block, ZeRO-2, bf16 weights: sd2-base's FSDP option (its YAML gives the
# override that switches it on), timed against the DDP baseline.
FSDP = "+trainer.parallelism_config={fsdp: {sharding_strategy: SHARD_GRAD_OP, mixed_precision: PURE}}"
# The switches of the recipe's step, one at a time on top of the eager one: weights held in bf16
# (fp32 master weights in the optimizer), the UNet's forward and backward compiled and replayed as
# CUDA graphs, channels-last memory.
BF16 = "model.param_dtype=bfloat16"
GRAPHS = ["model.compile_unet={mode: reduce-overhead}", "optimizer.capturable=true"]
CHANNELS_LAST = "model.channels_last=true"
VARIANTS = {  # name -> overrides on top of the recipe; the first is the baseline
    BASE: [EAGER],
    "bf16 weights": [EAGER, BF16],
    "compile": [EAGER, "model.compile_unet=true"],
    "compile + CUDA graphs": [EAGER, *GRAPHS],
    "compile, channels_last": [EAGER, "model.compile_unet=true", CHANNELS_LAST],
    FULL: [COMPILED_STEP],  # the recipe's own step, named
    # CUDA graphs replayed twice a batch (gradient accumulation): a known hazard, exercised here
    FULL_2: [COMPILED_STEP, "TWO_MICROBATCHES"],
    "FSDP per block": [EAGER, FSDP],  # what sharding costs a model that fits (the recipe's reason for DDP)
    "2x microbatch": [EAGER, "MICROBATCH_X2"],
    # Training draws keyed per sample (models/engine/draw_keys.py: CPU generators, the host's time), what the
    # sharded recipes use: whether sd2-base's compiled step can take them too (docs/benchmarks.md).
    PER_SAMPLE: [COMPILED_STEP, "+model.train_draws=sample"],
}
# SDXL's recipe is FSDP (full shard, per block) with activation checkpointing: what each costs.
SDXL_VARIANTS = {
    "baseline (FSDP full shard per block, activation checkpointing)": [],
    "SHARD_GRAD_OP": ["trainer.parallelism_config.fsdp.sharding_strategy=SHARD_GRAD_OP"],
    "no activation checkpointing": [
        "model.activation_checkpointing=null",
        "trainer.parallelism_config.fsdp.activation_checkpointing=false",
    ],
    "2x microbatch": ["MICROBATCH_X2"],
    "channels_last": ["model.channels_last=true"],
    "compile": ["model.compile_unet=true"],
}
# SD3 medium's recipe is FSDP2 (full shard over a node, one unit per joint block) without activation
# checkpointing at 256 px: what the sharding costs, what checkpointing would, and compile.
SD3_VARIANTS = {
    "baseline (FSDP2 full shard per joint block)": [],
    "no reshard after forward (ZeRO-2)": ["parallelism.reshard_after_forward=false"],
    "activation checkpointing, 2x microbatch": ["model.activation_checkpointing=blocks", "MICROBATCH_X2"],
    "2x microbatch": ["MICROBATCH_X2"],
    "compile": ["model.compile_unet=true"],
    "rank draws (not per sample)": ["model.train_draws=rank"],  # what the recipe's per-sample draws cost
}
# Flux at full width and reduced depth (bench/gpu/depth_extrapolation.py: why, and why the extrapolation
# per block is fair): the depths timed, 1 or 3 double-stream and 2 or 6 single-stream blocks (the
# first three fix the line, the fourth checks it); the largest, 1.9 B parameters with AdamW's fp32 state
# (~30 GB) and its activations at microbatch 16, fits an 80 GB H100 (estimated, not yet measured).
FLUX_DEPTHS = [
    {"num_layers": double, "num_single_layers": single} for double, single in ((1, 2), (3, 2), (1, 6), (3, 6))
]
DEPTH_JOB = "full depth, extrapolated per block (peak GB: the full model's, unsharded)"
# What `--preset` measures: its recipe, random latents (recipes/prepare.py), microbatch per
# resolution, variants and anchors (img/s per GPU and where the number comes from; none public for SDXL);
# or, with `depth`, the depth job alone at each resolution (no recipe: bench/gpu/depth_extrapolation.py).
TARGETS = {
    "sd2-base": dict(recipe="yamls/sd2-base.yaml", data="sd2-latents", microbatch=MICROBATCH,
                     variants=VARIANTS, anchors=ANCHORS),
    "sdxl-base": dict(recipe="yamls/sdxl-base.yaml", data="sdxl-latents", microbatch={512: 8, 1024: 2},
                      variants=SDXL_VARIANTS, anchors={}),
    "sd3-medium": dict(recipe="yamls/sd3-medium.yaml", data="sd3-latents", microbatch={256: 32, 512: 8},
                       variants=SD3_VARIANTS, anchors={}),
    # MLPerf's 256 px; 16 a GPU: the global batch of 512 (MLPerf's smallest) on 32 GPUs. Its anchor
    # is an MFU, printed beside the row: torchtitan's 26.1% for Flux-dev on GB200 (issue 40).
    "flux-schnell": dict(microbatch={256: 16}, variants={}, anchors={},
                         depth=dict(preset="flux-schnell", depths=FLUX_DEPTHS, device="cuda"),
                         mfu_anchor=(0.261, "torchtitan's Flux-dev on GB200")),
}  # fmt: skip


def gpus() -> int:
    import torch

    if not torch.cuda.is_available():
        sys.exit("gpu-check needs a CUDA GPU; none is visible here (torch.cuda.is_available() is False)")
    return torch.cuda.device_count()


def batch_sizes(resolution: int, variant: list[str], preset: str = "sd2-base") -> tuple[int, int]:
    """(microbatch, batch per GPU) of a variant: the preset's microbatch at `resolution`, doubled by
    MICROBATCH_X2; TWO_MICROBATCHES makes the batch twice the microbatch (gradient accumulation)."""
    micro = TARGETS[preset]["microbatch"][resolution] * (2 if "MICROBATCH_X2" in variant else 1)
    return micro, micro * (2 if "TWO_MICROBATCHES" in variant else 1)


def variant_overrides(
    n: int, resolution: int, variant: list[str], preset: str = "sd2-base"
) -> tuple[int, list[str]]:
    """(microbatch, the overrides bench/throughput.py gets) for a variant on `n` GPUs."""
    micro, batch = batch_sizes(resolution, variant, preset)
    sizes = [f"global_train_batch_size={batch * n}", f"trainer.device_train_microbatch_size={micro}"]
    data = [o.replace("sd2-latents", TARGETS[preset]["data"]) for o in DATA]
    if preset != "sd2-base":  # one flat set of square latents, not the recipe's buckets
        data += ["data.train.buckets=false", "data.train.batching_method=random"]
    return micro, [
        *data,
        f"data.train.resolution={resolution}",
        *sizes,
        *(o for o in variant if o not in MARKERS),
    ]


def latents(out: Path, preset: str, resolution: int, n: int, batches: int) -> Path:
    """Random latents (recipes/prepare.py) at `resolution` for all of `preset`'s variants on `n` GPUs,
    made in this one process (not by every rank) unless there: the largest batch per GPU of the variants
    times the warm-up, timed and profiled batches and one more, so that no variant's measured batches
    cross an epoch's end (where the data loader's workers restart). The count is in the folder's name,
    so a folder made for fewer batches or GPUs is not reused."""
    from recipes.prepare import prepare_random_latents

    largest = max(batch_sizes(resolution, v, preset)[1] for v in TARGETS[preset]["variants"].values())
    samples = largest * n * (WARMUP + batches + PROFILE_STEPS + 1)
    folder = out / f"latents-{preset}-{resolution}px-{samples}"
    return prepare_random_latents(folder, preset, n=samples, resolutions=(resolution,))


def slug(name: str, resolution: int | None) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") + (f"-{resolution}" if resolution else "")


def next_number(out: Path) -> int:
    """One more than the highest K among OUT/tp-PX-K.json and .log: counted by logs too, since a failed
    variant writes no json, so the next one cannot take its number and overwrite its log."""
    names = (re.fullmatch(r"tp-\d+-(\d+)\.(json|log)", f.name) for f in out.glob("tp-*"))
    return max((int(m[1]) for m in names if m), default=-1) + 1


def throughput(
    n: int,
    out: Path,
    resolution: int,
    name: str,
    overrides: list[str],
    batches: int,
    preset: str = "sd2-base",
    timeout: float = 900,
) -> dict:
    """One variant's row: img/s per GPU, MFU, peak memory, and its profile's numbers (the profile in
    OUT/profile-VARIANT-PX.json), or `ok: False` and the log."""
    from models.flops import mfu, training_flops_per_image

    micro, overrides = variant_overrides(n, resolution, overrides, preset)
    result_file = out / f"tp-{resolution}-{next_number(out)}.json"
    profile = out / f"profile-{slug(name, resolution)}.json"
    args = ["bench/throughput.py", TARGETS[preset]["recipe"], *overrides, "--batches", str(batches)]
    data = latents(out, preset, resolution, n, batches)
    args += ["--warmup", str(WARMUP), "--data", str(data), "--out", str(result_file)]
    args += ["--profile", str(profile), "--profile-steps", str(PROFILE_STEPS)]
    profile.unlink(missing_ok=True)  # not a previous call's, on the same machine
    done = composer(n, args, result_file.with_suffix(".log"), timeout=timeout)
    row = {"variant": name, "resolution": resolution, "microbatch": micro, "ok": done.returncode == 0}
    if row["ok"] and result_file.exists():
        result = json.loads(result_file.read_text())
        row.update(
            img_s=result["img_per_sec_per_gpu"], memory_gb=result.get("peak_memory_gb"), file=str(result_file)
        )
        row["mfu"] = mfu(row["img_s"], training_flops_per_image(preset, resolution), peak_flops())
        add_profile(row, profile)
    else:
        row.update(ok=False, log=str(result_file.with_suffix(".log")))
        row["timed_out"] = done.returncode == 124
    return row


def main(argv: list[str] | None = None, start: float | None = None) -> int:
    """`start`: the time.monotonic() --budget counts from (the script passes START; default: now)."""
    start = time.monotonic() if start is None else start
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--out", type=Path, default=REPO / "runs/gpu-check")
    parser.add_argument("--run", type=int, choices=sorted(RUNS), help="one of RUNS (sd2-base; default 1)")
    parser.add_argument(
        "--budget", type=float, default=BUDGET_S,
        help=f"seconds for the jobs from this script's start (default {BUDGET_S}; 0: no limit)",
    )  # fmt: skip
    parser.add_argument("--parts", nargs="+", choices=("throughput", "e2e", "ema"))
    parser.add_argument("--quick", action="store_true", help="the baseline variant only, fewer batches")
    parser.add_argument(
        "--variants", nargs="+", metavar="TEXT", help="only the variants whose name contains one of these"
    )
    parser.add_argument(
        "--preset", choices=sorted(TARGETS), default="sd2-base",
        help="the recipe measured: sd2-base (all parts), sdxl-base (throughput at 512 and 1024 px), "
        "sd3-medium (throughput at 256 and 512 px) or flux-schnell (full width, reduced depth, "
        "extrapolated per block, at 256 px)",
    )  # fmt: skip
    parser.add_argument(
        "--resolutions", nargs="+", type=int, choices=(256, 512, 1024),
        help="throughput at these (default: the preset's two): the higher runs the baseline and the "
        "lower's best (or --variants alone)",
    )  # fmt: skip
    parser.add_argument(
        "--deterministic", action="store_true",
        help="e2e in Composer's deterministic mode, where the resume must be bitwise (runs do this)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    chosen = args.parts or args.variants or args.resolutions or args.quick or args.preset != "sd2-base"
    if chosen and args.run is not None:
        parser.error("--run is a fixed plan of sd2-base jobs: no --parts, --variants, --resolutions, --quick")
    target = TARGETS[args.preset]
    sizes = sorted(target["microbatch"])
    if not set(args.resolutions or sizes) <= set(sizes):
        parser.error(f"--preset {args.preset} measures at {sizes} px, not {args.resolutions}")
    if "depth" in target:
        jobs = [("depth", DEPTH_JOB, px) for px in sorted(args.resolutions or sizes)]
        stem = f"gpu-check-{args.preset}"
    elif chosen:
        parts = args.parts or ["throughput", "e2e", "ema"]
        parts = parts if args.preset == "sd2-base" else [p for p in parts if p == "throughput"]
        jobs = custom_jobs(args.preset, target, args.quick, args.variants, args.resolutions or sizes, parts)
        stem = "gpu-check" if args.preset == "sd2-base" else f"gpu-check-{args.preset}"
    else:
        args.run = args.run or 1
        jobs, stem = RUNS[args.run], f"gpu-check-run{args.run}"
    args.batches, args.start = (10 if args.quick else 20), start
    n = gpus()
    args.out.mkdir(parents=True, exist_ok=True)
    measure = {"throughput": throughput, "plain": plain_row, "depth": depth_row}  # the rows run_jobs asks for
    return run_and_report(jobs, n, args, stem, target, measure)


if __name__ == "__main__":
    sys.exit(main(start=START))
