"""A preset too large for one GPU, timed at its full width and reduced depth and extrapolated per
block: `make gpu-check PRESET=flux-schnell`'s job (bench/gpu/gpu_check.py runs this file in its own
process, `depth_row`).

    python bench/gpu/depth_extrapolation.py --preset flux-schnell --resolution 256 --batch 16 \
        --depths num_layers=1,num_single_layers=2 num_layers=3,num_single_layers=2 ... --out R.json

Why not the whole model: flux-schnell's transformer has 11.9 B parameters; AdamW with fp32 weights,
gradients and two moments holds 16 bytes a parameter, ~190 GB before activations, more than one
80 GB H100 (the MLPerf recipe shards it over a node).

Why the extrapolation is fair: the transformer is a stack of identical blocks of two kinds (Flux: 19
double-stream and 38 single-stream, each kind the same shapes, kernels and parameters), run one after
another, so a training step's time is linear in the numbers of blocks, t = fixed + sum_k n_k c_k: each
block adds its forward, backward and AdamW update (per parameter, and a block's parameters are the
same in every block of a kind), while what is not a block (the embedders of latents, T5 context,
timestep and pooled vector, the final norm and projection, the latent sampling, caption dropout, loss
and launch overhead) runs once a step at any depth: the `fixed` term, counted once. Timing the step
at depths that separate the kinds (1+2, 3+2, 1+6 blocks) fixes `fixed` and each c_k; a fourth depth
(3+6) checks the line (`max_residual`: the worst depth's distance from the fit, relative). The FLOPs
follow the same line exactly (tests/test_gpu_depth.py fits the meta-device counts), so MFU is the
full model's FLOPs (models/flops.py at full depth) over the extrapolated step time; the peak memory
too is linear (weights, gradients, optimizer state and saved activations per block), extrapolated to
what the full model would hold on one GPU unsharded. Not seen here: the sharded recipe's all-gathers
and reduce-scatters, which overlap the blocks' compute when they run well.

The step is recipes/reference_step.py's (forward, loss, backward, fused AdamW on CUDA) under bf16
autocast over fp32 weights, on random precomputed encodings (models/stored_form.py shapes) with
MLPerf's caption dropout 0.1 on a stored empty caption, so the frozen VAE and text encoders (T5-XXL:
4.7 B) never run and are only built on the meta device.
"""

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if __name__ == "__main__":  # run as a script (gpu_check's job): the repo, not bench/gpu/, on the path
    sys.path[0] = str(REPO)  # (bench/ on it would let bench/convert.py shadow the convert package)

import numpy as np  # noqa: E402
import torch  # noqa: E402

# 0.1: MLPerf Flux.1's caption dropout (issue 40); the step pays its torch.where()s.
CAPTION_DROP = 0.1
WARMUP = 3  # steps before the timed ones: cuDNN/cuBLAS autotuning and the allocator's first growth


def reduced_denoiser(preset: str, depth: dict, device):
    """`preset`'s denoiser with its config's depth keys (`depth`: e.g. {num_layers: 1}) replaced,
    built directly on `device` (a meta one costs nothing; a CUDA one skips the CPU's random init)."""
    from models.engine.family import construct
    from models.registry import PRESETS, of

    family = of(preset)
    config = PRESETS[preset][family.denoiser]
    if unknown := set(depth) - set(config):
        raise ValueError(f"{preset}'s {family.denoiser} has no {sorted(unknown)} in its config")
    with torch.device(device):
        return construct(family.components[family.denoiser], {**config, **depth})


def reduced_model(preset: str, depth: dict, device):
    """The preset's model (its family's class) with the reduced-depth denoiser on `device`, its frozen
    networks on the meta device (never run: encodings are precomputed and the empty caption stored)."""
    from models.components import build_components
    from models.registry import PRESETS, of, preset_options
    from models.stored_form import stored_shapes

    family = of(preset)
    networks = [n for n, cls in family.components.items() if issubclass(cls, torch.nn.Module)]
    with torch.device("meta"):
        frozen = build_components(preset, skip=(family.denoiser, "noise_scheduler"))
    frozen = {name: part for name, part in frozen.items() if name in networks}
    rest = build_components(preset, skip=networks)  # the noise scheduler, latent scale and shift
    tokenizers = dict.fromkeys(n for n in family.components if n.startswith("tokenizer"))
    options = dict(preset_options(preset), caption_drop_prob=CAPTION_DROP)
    if family.objective == "flow":
        options["timestep_density"] = PRESETS[preset].get("timestep_density")
    denoiser = {family.denoiser: reduced_denoiser(preset, depth, device)}
    with torch.device(device):  # the model's own buffers (latent scale) and metrics
        model = family.model_class(**denoiser, **frozen, **rest, **tokenizers, **options)
    empty = {name: torch.randn(1, *shape) for name, shape in stored_shapes(preset).items()}
    model.set_empty_caption(empty)
    return model


def random_batch(preset: str, resolution: int, batch: int, device) -> dict:
    """Precomputed-encodings batch of `preset`'s shapes: VAE moments and the stored form of captions."""
    from models.presets import vae_factor
    from models.registry import PRESETS
    from models.stored_form import stored_shapes

    side, channels = resolution // vae_factor(preset), PRESETS[preset]["vae"]["latent_channels"]
    with torch.device(device):
        data = {"latents": torch.randn(batch, 2 * channels, side, side)}
        data["latents"][:, channels:] = -6.0  # small log-variances, as encoded latents have
        data.update({name: torch.randn(batch, *shape) for name, shape in stored_shapes(preset).items()})
    return data


def _timed(step) -> float:
    start = time.perf_counter()
    step()
    return time.perf_counter() - start


def time_depth(preset, depth, resolution, batch, steps, warmup=WARMUP, device="cuda") -> dict:
    """Seconds per training step and peak GB (CUDA) of the reduced-depth model, fresh on `device`."""
    from recipes.reference_step import train_step

    device = torch.device(device)
    torch.manual_seed(0)
    model = reduced_model(preset, depth, device)
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-5, fused=device.type == "cuda")
    data = random_batch(preset, resolution, batch, device)
    cuda = device.type == "cuda"

    def step():
        train_step(model, data, optimizer, precision="amp_bf16")  # bf16 autocast on CUDA

    for _ in range(warmup):
        step()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    if cuda:  # queued steps, one synchronisation: the mean of `steps`
        start = time.perf_counter()
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
        seconds = (time.perf_counter() - start) / steps
    else:  # the best of `steps`: a shared CPU's other work only ever adds time (a mean of 2 once fit a
        # negative per-block cost on the tests' tiny depths)
        seconds = min(_timed(step) for _ in range(steps))
    peak = torch.cuda.max_memory_allocated() / 1e9 if cuda else None
    parameters = sum(p.numel() for p in trainable)
    model = optimizer = data = None  # free the device for the next depth
    if cuda:
        torch.cuda.empty_cache()
    return {"depth": depth, "step_s": seconds, "peak_gb": peak, "parameters": parameters}


def fit(depths: list[dict], values: list[float], keys: list[str]) -> tuple[np.ndarray, float]:
    """Least squares of value = fixed + sum_k n_k c_k over the measured depths: ([fixed, c_1, ...], the
    largest relative distance of a measured value from the line; 0 when the depths only just fix it)."""
    design = np.array([[1.0, *(d[k] for k in keys)] for d in depths])
    if np.linalg.matrix_rank(design) < len(keys) + 1:
        raise ValueError(f"the depths {depths} do not separate {keys}: give depths that vary each kind")
    coefficients, *_ = np.linalg.lstsq(design, np.array(values, dtype=float), rcond=None)
    residual = np.abs(design @ coefficients - values) / np.abs(values)
    return coefficients, float(residual.max())


def extrapolate(depths: list[dict], values: list[float], full: dict) -> tuple[float, np.ndarray, float]:
    """(the value at the `full` depth, the fit's coefficients, its largest relative residual)."""
    keys = sorted(full)
    coefficients, residual = fit(depths, values, keys)
    return float(coefficients @ np.array([1.0, *(full[k] for k in keys)])), coefficients, residual


def measure(preset, resolution, batch, depths, steps, warmup=WARMUP, device="cuda") -> dict:
    """Time each depth, fit, and extrapolate to the preset's own depth: the result record (also what
    recipes.plan reads: `img_per_sec_per_gpu`)."""
    from models.flops import mfu, training_flops_per_image
    from models.registry import PRESETS, of

    config = PRESETS[preset][of(preset).denoiser]
    keys = sorted({k for depth in depths for k in depth})
    full = {k: config[k] for k in keys}
    rows = []
    for depth in depths:
        rows.append(time_depth(preset, depth, resolution, batch, steps, warmup, device))
        print(
            f"depth {depth}: {rows[-1]['step_s'] * 1e3:.1f} ms a step, peak {rows[-1]['peak_gb']} GB",
            flush=True,
        )
    step_s, coefficients, residual = extrapolate(depths, [r["step_s"] for r in rows], full)
    if step_s <= 0:
        raise RuntimeError(
            f"the depth fit extrapolated a step of {step_s:.3g} s to {full} from timings "
            f"{[round(r['step_s'], 4) for r in rows]} (largest residual {residual:.0%}): too noisy to "
            "extrapolate; time more steps (--steps) on a quieter device"
        )
    peak = None
    if all(r["peak_gb"] is not None for r in rows):
        peak = extrapolate(depths, [r["peak_gb"] for r in rows], full)[0]
    flops = training_flops_per_image(preset, resolution)
    img_s = batch / step_s
    cuda = torch.device(device).type == "cuda"
    peak_flops = None
    if cuda:
        from bench.gpu.rows import peak_flops as device_peak

        peak_flops = device_peak()
    device_name = torch.cuda.get_device_name() if cuda else f"cpu ({torch.get_num_threads()} threads)"
    return {
        "img_per_sec_per_gpu": img_s,
        "resolution": resolution,
        "device": device_name,
        "preset": preset,
        "recipe": None,
        "extrapolated": f"from {len(depths)} reduced depths of {keys} to {full}, per block",
        "microbatch": batch,
        "step_s": step_s,
        "fit": {
            "fixed_s": float(coefficients[0]),
            **{f"{k}_s": float(c) for k, c in zip(keys, coefficients[1:])},
        },
        "max_residual": residual,
        "depths": rows,
        "full_depth": full,
        "flops_per_image": flops,
        "mfu": mfu(img_s, flops, peak_flops) if peak_flops else None,
        "peak_memory_gb_unsharded": peak,
        "torch": torch.__version__,
    }


def depth_row(out: Path, resolution: int, name: str, batches: int, target: dict, timeout: float) -> dict:
    """gpu_check's row of the depth job (`target`: its TARGETS entry, whose `depth` names the preset,
    the depths and the device): this file in its own process group, stopped past `timeout` (the
    job's limit), its record in OUT/depth-PRESET-PX.json (what recipes.plan reads, through
    OUT/throughput-PRESET-PX.json) and its log beside it."""
    import os

    from bench.gpu.gpu_runs import run_group

    spec, micro = target["depth"], target["microbatch"][resolution]
    result = out / f"depth-{spec['preset']}-{resolution}px.json"
    depths = [",".join(f"{k}={v}" for k, v in depth.items()) for depth in spec["depths"]]
    command = [sys.executable, str(Path(__file__).resolve()), "--preset", spec["preset"], "--resolution",
               str(resolution), "--batch", str(micro), "--depths", *depths, "--steps", str(batches),
               "--device", spec.get("device", "cuda"), "--out", str(result)]  # fmt: skip
    result.unlink(missing_ok=True)  # not an earlier call's
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "PYTHONPATH": path, "HF_HUB_OFFLINE": "1"}
    done = run_group(command, result.with_suffix(".log"), timeout, env)
    row = {"variant": name, "resolution": resolution, "microbatch": micro, "ok": done.returncode == 0}
    if row["ok"] and result.exists():
        record = json.loads(result.read_text())
        mfu = record["mfu"] if record["mfu"] is not None else float("nan")
        row.update(
            img_s=record["img_per_sec_per_gpu"], mfu=mfu, memory_gb=record["peak_memory_gb_unsharded"],
            file=str(result), step_s=record["step_s"], max_residual=record["max_residual"],
        )  # fmt: skip
    else:
        row.update(ok=False, log=str(result.with_suffix(".log")), timed_out=done.returncode == 124)
    return row


def parse_depth(text: str) -> dict:
    """`num_layers=1,num_single_layers=2` -> {"num_layers": 1, "num_single_layers": 2}."""
    try:
        return {k: int(v) for k, v in (item.split("=") for item in text.split(","))}
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r}: give KEY=N,KEY=N (a denoiser config's depth keys)"
        ) from None


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--preset", default="flux-schnell")
    parser.add_argument("--resolution", type=int, default=256)
    parser.add_argument("--batch", type=int, default=16, help="images a step (one microbatch)")
    parser.add_argument("--depths", type=parse_depth, nargs="+", required=True)
    parser.add_argument("--steps", type=int, default=20, help="timed steps per depth")
    parser.add_argument("--warmup", type=int, default=WARMUP)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", type=Path, required=True, help="the result record (JSON)")
    args = parser.parse_args(argv)
    result = measure(
        args.preset, args.resolution, args.batch, args.depths, args.steps, args.warmup, args.device
    )
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    mfu = f", MFU {result['mfu']:.1%}" if result["mfu"] is not None else ""
    print(
        f"{args.preset} at {args.resolution} px, full depth {result['full_depth']} extrapolated: "
        f"{result['step_s'] * 1e3:.0f} ms a step of {args.batch}, {result['img_per_sec_per_gpu']:.2f} img/s"
        f"{mfu}; fit residual {result['max_residual']:.1%} -> {args.out}"
    )
    return result


if __name__ == "__main__":
    main()
