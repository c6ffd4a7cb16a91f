"""`make gpu-check`: the GPU path of yamls/sd2-base.yaml, measured and checked, on the GPUs at hand.

    python bench/gpu_check.py [--out runs/gpu-check] [--parts throughput e2e ema] [--quick]
                                [--variants TEXT ...] [--resolutions 256 512]
                                [--deterministic] [--preset sd2-base|sdxl-base|sd3-medium]

`--preset sdxl-base` measures yamls/sdxl-base.yaml instead (throughput only, at 512 and 1024 px:
its FSDP recipe and SDXL_VARIANTS, random SDXL-shaped latents with pooled text and micro-conditioning);
`--preset sd3-medium` yamls/sd3-medium.yaml (at 256 and 512 px, SD3_VARIANTS, random 16-channel
latents with the CLIP context and pooled vector).

1. throughput: bench/throughput.py (each variant its own `composer -n GPUS` process) on sd2-base,
   bf16, precomputed latents (random, `data.prepare: sd2-latents`): img/s per GPU, MFU (UNet
   training FLOPs, models/flops.py, against Composer's peak for the GPU) and peak memory, for the
   variants in VARIANTS at 256 px and the baseline and best at 512 px. The best is written to
   OUT/throughput-256.json / -512.json, which `recipes.plan --throughput-file` reads.
2. e2e: the real yamls/sd2-base.yaml (overrides only for data, duration, batch, save folder, and EMA
   switched on as the 512 px stage has it) trains 50 batches under FSDP and saves at 25 and 50; a
   second run resumes from batch 25 and must train the same losses (bitwise weights too with
   --deterministic; bench/gpu_e2e.py says why not by default); the final checkpoint is exported and
   the pipeline generates an image.
3. ema: the EMA's storage variants (fp32 on the GPU, bf16, CPU offload) give the same average.
Prints a markdown table with the anchors' ratios; exits non-zero if a check fails. Without CUDA
it exits at once with one line. Needs no network: the weights are random.
"""

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[0] = str(REPO)  # not bench/: its convert.py would shadow the convert package

from bench.gpu_e2e import DATA, part_e2e  # noqa: E402 (after the path fix)

ANCHORS = {  # img/s per GPU to reach, and where the number comes from
    256: (440.0, "MosaicML's 23.8% MFU on A100 carried to H100"),
    512: (124.0, "NVIDIA's MLPerf Training v4.1 SD per H100"),
}
MICROBATCH = {256: 32, 512: 16}
# The UNet sharded per block, ZeRO-2, bf16 weights: sd2-base's FSDP option (its YAML gives the
# override that switches it on), timed against the DDP baseline.
FSDP = "+trainer.parallelism_config={fsdp: {sharding_strategy: SHARD_GRAD_OP, mixed_precision: PURE}}"
VARIANTS = {  # name -> overrides on top of the recipe; the first is the baseline
    "baseline (sdpa, DDP / no wrapper on 1 GPU)": [],
    "math attention": ["model.attention=math"],
    "channels_last": ["model.channels_last=true"],
    "compile": ["model.compile_unet=true"],
    "gradient checkpointing, 2x microbatch": ["model.gradient_checkpointing=true", "MICROBATCH_X2"],
    "2x microbatch": ["MICROBATCH_X2"],
    # On an H100 the 256 px step is launch-bound (FSDP per block ran at 0.58x a plain loop,
    # docs/benchmarks.md "GPU figures"); these tell what FSDP's hooks and the norms' casts cost.
    "FSDP per block": [FSDP],
    "FSDP: whole UNet": [FSDP, "model.fsdp_wrap=unet"],
    "FSDP: per layer": [FSDP, "model.fsdp_wrap=layers"],
    "FSDP, checkpointing, 2x microbatch": [
        FSDP,
        "model.activation_checkpointing=blocks",
        "trainer.parallelism_config.fsdp.activation_checkpointing=true",
        "+trainer.parallelism_config.fsdp.activation_checkpointing_reentrant=false",
        "MICROBATCH_X2",
    ],
    "no low-precision norms": ["model.low_precision_norms=null"],
}
PLAIN = "plain PyTorch loop, 1 GPU (the ceiling)"
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
# SD3 medium's recipe is FSDP (full shard, one unit per joint block) without activation checkpointing
# at 256 px: what the sharding costs, what checkpointing would, and compile.
SD3_VARIANTS = {
    "baseline (FSDP full shard per joint block)": [],
    "SHARD_GRAD_OP": ["trainer.parallelism_config.fsdp.sharding_strategy=SHARD_GRAD_OP"],
    "activation checkpointing, 2x microbatch": ["model.activation_checkpointing=blocks", "MICROBATCH_X2"],
    "2x microbatch": ["MICROBATCH_X2"],
    "compile": ["model.compile_unet=true"],
}
# What `--preset` measures: its recipe, random latents (recipes/prepare.py), microbatch per
# resolution, variants and anchors (img/s per GPU and where the number comes from; none public for SDXL).
TARGETS = {
    "sd2-base": dict(
        recipe="yamls/sd2-base.yaml",
        data="sd2-latents",
        microbatch=MICROBATCH,
        variants=VARIANTS,
        anchors=ANCHORS,
    ),
    "sdxl-base": dict(
        recipe="yamls/sdxl-base.yaml",
        data="sdxl-latents",
        microbatch={512: 8, 1024: 2},
        variants=SDXL_VARIANTS,
        anchors={},
    ),
    "sd3-medium": dict(
        recipe="yamls/sd3-medium.yaml",
        data="sd3-latents",
        microbatch={256: 32, 512: 8},
        variants=SD3_VARIANTS,
        anchors={},
    ),
}


def gpus() -> int:
    import torch

    if not torch.cuda.is_available():
        sys.exit("gpu-check needs a CUDA GPU; none is visible here (torch.cuda.is_available() is False)")
    return torch.cuda.device_count()


def composer(n: int, args: list[str], log: Path, timeout: int) -> subprocess.CompletedProcess:
    # this interpreter's launcher, so the check also runs where the packages are not in .venv
    command = [sys.executable, "-m", "composer.cli.launcher", "-n", str(n), *args]
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "PYTHONPATH": path, "WANDB_MODE": "disabled", "HF_HUB_OFFLINE": "1"}
    with open(log, "w") as out:
        return subprocess.run(
            command, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, timeout=timeout
        )


def variant_overrides(
    n: int, resolution: int, variant: list[str], preset: str = "sd2-base"
) -> tuple[int, list[str]]:
    """(microbatch, the overrides bench/throughput.py gets) for a variant on `n` GPUs."""
    target = TARGETS[preset]
    micro = target["microbatch"][resolution] * (2 if "MICROBATCH_X2" in variant else 1)
    sizes = [f"global_train_batch_size={micro * n}", f"trainer.device_train_microbatch_size={micro}"]
    data = [o.replace("sd2-latents", target["data"]) for o in DATA]
    if preset != "sd2-base":  # one flat set of square latents, not the recipe's buckets
        data += ["data.train.buckets=false", "data.train.batching_method=random"]
    return micro, [
        *data,
        f"data.train.resolution={resolution}",
        *sizes,
        *(o for o in variant if o != "MICROBATCH_X2"),
    ]


def throughput(
    n: int,
    out: Path,
    resolution: int,
    name: str,
    overrides: list[str],
    batches: int,
    preset: str = "sd2-base",
) -> dict:
    from models.flops import mfu, training_flops_per_image

    micro, overrides = variant_overrides(n, resolution, overrides, preset)
    result_file = out / f"tp-{resolution}-{len(list(out.glob('tp-*.json')))}.json"
    args = ["bench/throughput.py", TARGETS[preset]["recipe"], *overrides, "--batches", str(batches)]
    data = out / ("latents" if preset == "sd2-base" else f"latents-{preset}")
    args += ["--warmup", "5", "--data", str(data), "--out", str(result_file)]
    done = composer(n, args, result_file.with_suffix(".log"), timeout=900)
    row = {"variant": name, "resolution": resolution, "microbatch": micro, "ok": done.returncode == 0}
    if row["ok"]:
        result = json.loads(result_file.read_text())
        row.update(
            img_s=result["img_per_sec_per_gpu"], memory_gb=result.get("peak_memory_gb"), file=result_file
        )
        row["mfu"] = mfu(row["img_s"], training_flops_per_image(preset, resolution), peak_flops())
    else:
        row["log"] = str(result_file.with_suffix(".log"))
    return row


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


def plain_loop(preset: str, resolution: int, batch: int, steps: int = 20, warmup: int = 5, device="cuda"):
    """(img/s, peak GB) of a plain PyTorch loop over the recipe's model, the ceiling the training
    path is compared with: `model.loss(model(batch))`, backward, fused AdamW, bf16 autocast on CUDA,
    on batches already on the device; no Composer, FSDP, callbacks or data loader."""
    import torch

    from models import build_model
    from models.flops import latent_size
    from models.presets import family

    device = torch.device(device)
    torch.manual_seed(0)
    model = build_model(preset).to(device)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5, fused=True)
    size = latent_size(preset, resolution)
    # The VAE's mean and log-variance, as convert latents writes them, for the UNet or transformer.
    moments = 2 * model.denoiser.config.in_channels
    # The stored text condition: each CLIP's hidden states side by side (SDXL's and SD3's two), and the
    # pooled vector SDXL (bigG's) and SD3 (both CLIPs') condition on.
    encoders = [model.text_encoder, getattr(model, "text_encoder_2", None)]
    width = sum(encoder.config.hidden_size for encoder in encoders if encoder is not None)
    data = {
        "latents": torch.randn(batch, moments, size, size, device=device),
        "text_embeds": torch.randn(batch, 77, width, device=device),
    }
    if family(preset) == "sdxl":
        pooled = model.text_encoder_2.config.projection_dim
    elif family(preset) == "mmdit":
        pooled = model.denoiser.config.pooled_projection_dim
    if family(preset) != "sd":
        data["pooled_text_embeds"] = torch.randn(batch, pooled, device=device)

    def step():
        with torch.autocast(device.type, torch.bfloat16, enabled=device.type == "cuda"):
            loss = model.loss(model(data), data)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

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
    model = optimizer = data = None  # free the GPU for the next variants (own processes)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return img_s, peak


def part_throughput(
    n: int, out: Path, quick: bool, only: list[str] | None = None, resolutions=(256, 512), preset="sd2-base"
) -> list[dict]:
    from models.flops import mfu, training_flops_per_image

    variants = TARGETS[preset]["variants"]
    low, high = sorted(TARGETS[preset]["microbatch"])
    batches = 10 if quick else 20
    names = list(variants)[:1] if quick else list(variants)
    if only:  # the baseline always runs: every ratio in the table is against it
        names = [names[0], *(name for name in variants if name != names[0] and any(o in name for o in only))]
    rows = []

    def measure(resolution: int, name: str) -> None:
        rows.append(throughput(n, out, resolution, name, variants[name], batches, preset))
        print(f"measured: {rows[-1]}", flush=True)  # a run cut short still shows what it measured

    if low in resolutions:
        for name in names:
            measure(low, name)
    if high in resolutions:  # the baseline and the lower size's best, or the chosen variants alone
        best = max((r for r in rows if r["ok"]), key=lambda r: r["img_s"], default=None)
        for name in dict.fromkeys([names[0], best["variant"]] if best else names):
            measure(high, name)
    for resolution in (low, high):
        done = [r for r in rows if r["ok"] and r["resolution"] == resolution]
        if done:
            top = max(done, key=lambda r: r["img_s"])
            suffix = "" if preset == "sd2-base" else f"-{preset}"
            (out / f"throughput{suffix}-{resolution}.json").write_text(Path(top["file"]).read_text())
    if preset != "sd2-base" or 256 not in resolutions:  # the plain-loop ceiling: sd2-base's
        return rows
    micro = MICROBATCH[256]  # last: this process then holds the GPU only while no variant runs
    img_s, peak = plain_loop("sd2-base", 256, micro, steps=batches)
    rows.append(
        {"variant": PLAIN, "resolution": 256, "microbatch": micro, "ok": True, "img_s": img_s,
         "memory_gb": peak, "mfu": mfu(img_s, training_flops_per_image("sd2-base", 256), peak_flops())}
    )  # fmt: skip
    return rows


def part_ema() -> tuple[list[str], dict[str, float]]:
    """The average of 20 updates of sd2-base's UNet shape, per storage variant, against fp32, and
    each variant's median milliseconds per update (the offload trade-off: host memory vs time)."""
    import torch

    from extensions.ema import EMA
    from models.presets import build_components

    unet = build_components("sd2-base")["unet"].cuda()
    averages, ms = {}, {}
    for name, kwargs in {"fp32": {}, "bf16": {"storage": "bf16"}, "offload": {"offload": True}}.items():
        torch.manual_seed(0)
        for p in unet.parameters():
            p.data.normal_(0, 0.02)
        ema = EMA(smoothing=0.9, **kwargs)
        ema._bind(unet)
        times = []
        for batch in range(20):
            with torch.no_grad():
                for p in unet.parameters():
                    p.add_(torch.randn_like(p), alpha=0.01)
            torch.cuda.synchronize()
            start = time.perf_counter()
            ema.step(batch)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        ms[name] = 1000 * sorted(times[5:])[len(times[5:]) // 2]
        averages[name] = {k: v.float().cpu() for k, v in ema.state_dict()["ema"].items()}
    problems = []
    for name, tolerance in (("bf16", 1e-2), ("offload", 1e-6)):
        worst = max((averages[name][k] - v).abs().max().item() for k, v in averages["fp32"].items())
        if worst > tolerance:
            problems.append(f"EMA {name} differs from fp32 by {worst:.2e} (> {tolerance:g})")
    return problems, ms


def table(rows: list[dict], anchors: dict = ANCHORS) -> str:
    lines = [
        "| variant | px | microbatch | img/s per GPU | MFU | peak GB | vs anchor |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        if not r["ok"]:
            lines.append(
                f"| {r['variant']} | {r['resolution']} | {r['microbatch']} | failed: {r['log']} | | | |"
            )
            continue
        anchor = anchors.get(r["resolution"], (None,))[0]
        versus = f"{r['img_s'] / anchor:.2f}x" if anchor else "-"
        memory = f"{r['memory_gb']:.1f}" if r.get("memory_gb") is not None else "?"
        lines.append(
            f"| {r['variant']} | {r['resolution']} | {r['microbatch']} | {r['img_s']:.1f} | {r['mfu']:.1%} "
            f"| {memory} | {versus} |"
        )
    anchor_text = (
        "; ".join(f"{px} px: {v:g} img/s ({why})" for px, (v, why) in anchors.items()) or "none public"
    )
    ceiling = next((r for r in rows if r["variant"] == PLAIN), None)
    base = next((r for r in rows if r["ok"] and r["variant"] != PLAIN and r["resolution"] == 256), None)
    if ceiling and base and base["microbatch"] == ceiling["microbatch"]:
        anchor_text += f". {base['variant']} / plain loop at 256 px: {base['img_s'] / ceiling['img_s']:.2f}x"
    return "\n".join(lines) + f"\n\nAnchors: {anchor_text}. Moonshot: 50% MFU.\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--out", type=Path, default=REPO / "runs/gpu-check")
    parser.add_argument(
        "--parts", nargs="+", choices=("throughput", "e2e", "ema"), default=["throughput", "e2e", "ema"]
    )
    parser.add_argument("--quick", action="store_true", help="the baseline variant only, fewer batches")
    parser.add_argument(
        "--variants", nargs="+", metavar="TEXT", help="only the variants whose name contains one of these"
    )
    parser.add_argument(
        "--preset", choices=sorted(TARGETS), default="sd2-base",
        help="the recipe measured: sd2-base (all parts), sdxl-base (throughput at 512 and 1024 px) or "
        "sd3-medium (throughput at 256 and 512 px)",
    )  # fmt: skip
    parser.add_argument(
        "--resolutions", nargs="+", type=int, choices=(256, 512, 1024),
        help="throughput at these (default: the preset's two): the higher runs the baseline and the "
        "lower's best (or --variants alone)",
    )  # fmt: skip
    parser.add_argument(
        "--deterministic", action="store_true",
        help="e2e in Composer's deterministic mode, where the resume must be bitwise (slower kernels)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    sizes = sorted(TARGETS[args.preset]["microbatch"])
    args.resolutions = args.resolutions or sizes
    if not set(args.resolutions) <= set(sizes):
        parser.error(f"--preset {args.preset} measures at {sizes} px, not {args.resolutions}")
    if args.preset != "sd2-base":
        args.parts = [part for part in args.parts if part == "throughput"]
    n = gpus()
    args.out.mkdir(parents=True, exist_ok=True)
    import torch

    device = torch.cuda.get_device_name()
    print(f"# gpu-check {time.strftime('%Y-%m-%d')}: {n} x {device}, torch {torch.__version__}")
    problems = []
    if "throughput" in args.parts:
        rows = part_throughput(n, args.out, args.quick, args.variants, args.resolutions, args.preset)
        print(table(rows, TARGETS[args.preset]["anchors"]))
        problems += [
            f"throughput variant failed: {r['variant']} at {r['resolution']} px" for r in rows if not r["ok"]
        ]
    if "ema" in args.parts:
        found, ms = part_ema()
        print("EMA variants (fp32, bf16, offload): " + ("agree" if not found else "; ".join(found)))
        print("EMA ms per update: " + ", ".join(f"{name} {value:.1f}" for name, value in ms.items()))
        problems += found
    if "e2e" in args.parts:
        found, lines = part_e2e(n, args.out, composer, args.deterministic)
        print("\n".join(lines))
        print("sd2-base train/save/resume/export/generate: " + ("ok" if not found else "; ".join(found)))
        problems += found
    for problem in problems:
        print(f"FAILED: {problem}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
