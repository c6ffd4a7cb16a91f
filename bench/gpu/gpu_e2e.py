"""gpu-check's end-to-end part: the real yamls/sd2-base.yaml trains, saves, resumes, exports and
generates on the GPUs at hand (bench/gpu/gpu_check.py --parts e2e).

Run A trains 50 batches and saves at 25 and 50; run B starts from A's batch-25 checkpoint and
trains to 50. On the CPU the resume is bitwise (tests/test_resume.py). On a GPU the backward pass
of some kernels (cuDNN convolution weight gradients, attention) adds in an unspecified order, so
two runs from the same state differ in the last bits of the weights even without a resume, so
unequal weights alone cannot tell a resume bug from kernel noise. What tells a
resume bug from that noise is the loss: B's batch 26 starts from A's state on the same data and
noise, so its forward pass sees the same numbers, and a wrong data order, RNG state or optimizer
state moves every later loss by whole percents while the kernels' noise moves them by ~1e-5.
`--deterministic` runs both with Composer's deterministic mode (torch's deterministic kernels,
a fixed cuBLAS workspace): then the weights too must be bitwise equal. gpu-check's run 2 does.

Also gpu-check's other check, `part_ema`: the EMA's storage variants agree, and what each costs.
"""

import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DATA = ["data.train.prepare=sd2-latents", "data.train.latents=true", "data.train.num_workers=4"]
RESUME_AT, BATCHES = 25, 50
LOSS_TOLERANCE = 1e-3  # relative; the kernels' noise after 25 batches is ~1e-5, a resume bug ~1e-2


def e2e_overrides(n: int, out: Path) -> list[str]:
    """yamls/sd2-base.yaml as it is, but for data, duration, batch, saving and EMA (on, as at 512 px)."""
    return [
        *DATA, f"data.train.local={out / 'latents'}", "data.train.remote=null", "data.train.resolution=256",
        "model.pretrained=null", "prepare_pretrained=null", "~loggers.wandb", "callbacks.samples=null",
        f"global_train_batch_size={8 * n}", "trainer.device_train_microbatch_size=8",
        f"trainer.max_duration={BATCHES}ba", f"trainer.save_interval={RESUME_AT}ba",
        "trainer.save_num_checkpoints_to_keep=-1",
        "+algorithms.ema._target_=extensions.ema.EMA", "+algorithms.ema.smoothing=0.99",
        "data.train.num_canonical_nodes=1", "trainer.progress_bar=false",
    ]  # fmt: skip


def run_overrides(folder: Path, deterministic: bool) -> list[str]:
    log = f"+callbacks.loss_log={{_target_: extensions.callbacks.LossLog, path: {folder / 'loss.jsonl'}}}"
    return [f"trainer.save_folder={folder}", log, *(["+trainer.deterministic_mode=true"] * deterministic)]


def part_e2e(
    n: int, out: Path, composer, deterministic: bool = False, deadline: float | None = None
) -> tuple[list[str], list[str]]:
    """(problems found, lines to print). `composer(n, args, log, timeout)` launches one run; every
    process is stopped by `deadline` (time.time()), a run that reaches it fails (exit 124)."""
    import os
    import shutil

    def left() -> float:
        return 1800 if deadline is None else max(deadline - time.time(), 1)

    cublas = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
    if deterministic:  # before the processes start: cuBLAS reads it when it creates its handle
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"
    try:
        base = ["train.py", "yamls/sd2-base.yaml", *e2e_overrides(n, out)]
        first, second = out / "e2e-a", out / "e2e-b"
        for folder in (first, second, out / "pipeline"):  # a second call on this machine starts afresh
            shutil.rmtree(folder, ignore_errors=True)
        done = composer(n, [*base, *run_overrides(first, deterministic)], out / "e2e-a.log", left())
        if done.returncode != 0:
            return [f"training failed (exit {done.returncode}); see {out / 'e2e-a.log'}"], []
        return _resume_and_compare(n, out, composer, deterministic, base, left)
    finally:  # the throughput variants after this one keep cuBLAS's default workspace
        if deterministic and cublas is None:
            os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)
        elif deterministic:
            os.environ["CUBLAS_WORKSPACE_CONFIG"] = cublas


def _resume_and_compare(n, out, composer, deterministic, base, left) -> tuple[list[str], list[str]]:
    import torch

    first, second = out / "e2e-a", out / "e2e-b"
    second.mkdir(parents=True, exist_ok=True)
    start = f"ep0-ba{RESUME_AT}-rank0.pt"
    (second / start).symlink_to(first / start)
    (second / "latest-rank0.pt").symlink_to(start)
    done = composer(n, [*base, *run_overrides(second, deterministic)], out / "e2e-b.log", left())
    if done.returncode != 0:
        return [f"resumed training failed (exit {done.returncode}); see {out / 'e2e-b.log'}"], []
    end = f"ep0-ba{BATCHES}-rank0.pt"
    a = torch.load(first / end, map_location="cpu", weights_only=False, mmap=True)["state"]
    b = torch.load(second / end, map_location="cpu", weights_only=False, mmap=True)["state"]
    problems, lines = compare_runs(first, second, a, b, bitwise=deterministic)
    (first / start).unlink()  # 15 GB each: the export below needs only the last one
    found, more = export_and_generate(first / end, out, timeout=left())
    return problems + found, lines + more


def compare_runs(first: Path, second: Path, a: dict, b: dict, bitwise: bool) -> tuple[list[str], list[str]]:
    """Run B (resumed) against run A (uninterrupted): every resumed batch's loss, then the
    checkpoints' `model` and `algorithms` (EMA) state. (problems, lines to print)."""
    from extensions.callbacks import read_loss_log

    loss_a, loss_b = read_loss_log(first / "loss.jsonl"), read_loss_log(second / "loss.jsonl")
    resumed = range(RESUME_AT + 1, BATCHES + 1)
    if missing := [i for i in resumed if i not in loss_a or i not in loss_b]:
        return [f"loss logs lack batches {missing[:5]}"], []
    rel = {i: abs(loss_a[i] - loss_b[i]) / max(abs(loss_a[i]), 1e-12) for i in resumed}
    first_batch = resumed[0]
    lines = [
        f"resumed batch {first_batch}: loss {loss_a[first_batch]:.8g} (A) vs {loss_b[first_batch]:.8g} (B)"
        + (" equal" if loss_a[first_batch] == loss_b[first_batch] else ""),
        f"batches {first_batch}-{BATCHES}: largest relative loss difference {max(rel.values()):.2e}",
    ]
    problems = []
    if max(rel.values()) > (0 if bitwise else LOSS_TOLERANCE):
        worst = max(rel, key=rel.get)
        problems.append(f"the resumed run's losses differ (relative) (batch {worst}: {rel[worst]:.1e})")
    for key in ("model", "algorithms"):
        diff, unequal, total = state_difference(a[key], b[key])
        if diff is None:
            problems.append(f"{key}: the two checkpoints hold differently named or shaped tensors")
            continue
        lines.append(f"{key}: {unequal} of {total} tensors differ, largest |A-B| {diff:.2e}")
        if bitwise and unequal:
            problems.append(f"{key}: the resume from batch {RESUME_AT} is not bitwise the uninterrupted run")
    return problems, lines


def state_difference(a: dict, b: dict) -> tuple[float | None, int, int]:
    """(largest absolute difference over all tensors, or None when names or shapes differ; how many
    tensors are not bitwise equal; how many there are)."""
    import torch

    flat_a, flat_b = _flat(a), _flat(b)
    if flat_a.keys() != flat_b.keys() or any(flat_a[k].shape != flat_b[k].shape for k in flat_a):
        return None, len(flat_a), len(flat_a)
    largest, unequal = 0.0, 0
    for key, x in flat_a.items():
        y = flat_b[key]
        if not torch.equal(x, y):
            unequal += 1
            largest = max(largest, (x.double() - y.double()).abs().max().item())
    return largest, unequal, len(flat_a)


def export_and_generate(checkpoint: Path, out: Path, timeout: float = 1800) -> tuple[list[str], list[str]]:
    import torch

    export = out / "pipeline"
    try:
        done = subprocess.run(
            [sys.executable, "-m", "models.export", str(checkpoint), str(export), "--ema"],
            cwd=REPO, capture_output=True, text=True, timeout=timeout,
        )  # fmt: skip
    except subprocess.TimeoutExpired:
        return [f"export did not finish within the time left ({timeout:.0f} s)"], []
    if done.returncode != 0:
        return [f"export failed: {done.stderr[-500:]}"], []
    from diffusers import StableDiffusionPipeline

    pipe = StableDiffusionPipeline.from_pretrained(export, dtype=torch.bfloat16).to("cuda")
    image = pipe("a photo", num_inference_steps=10, height=256, width=256).images[0]
    image.save(out / "e2e-image.png")
    return [], [f"exported and generated {out / 'e2e-image.png'}"]


def _flat(tree, prefix="") -> dict:
    import torch

    if isinstance(tree, torch.Tensor):
        return {prefix: tree}
    if isinstance(tree, dict):
        return {k: v for key, value in tree.items() for k, v in _flat(value, f"{prefix}/{key}").items()}
    if isinstance(tree, list | tuple):
        return {k: v for i, value in enumerate(tree) for k, v in _flat(value, f"{prefix}/{i}").items()}
    return {}


def part_ema() -> tuple[list[str], dict[str, float]]:
    """The average of 20 updates of sd2-base's UNet shape, per storage variant, against fp32, and
    each variant's median milliseconds per update (the offload trade-off: host memory vs time)."""
    import torch

    from extensions.ema import EMA
    from models.components import build_components

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
