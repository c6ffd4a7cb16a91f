"""EMA benchmark: extra peak memory and time per update, against the usual implementations.

    python bench/ema.py [--models tiny sd2-unet] [--updates 3]

Each variant runs in its own subprocess. "Extra peak (tensors)" is the peak of the bytes held by
tensors that setting up the EMA and one update created (counted exactly with a dispatch mode, so
the allocator's caching cannot hide or inflate it). "Extra peak RSS" cross-checks it from the OS:
VmHWM after the counter is reset (/proc/self/clear_refs) minus RSS before, minus the same for the
run without EMA; below a few MiB (the tiny model) it is allocator noise. Time is the median of
`--updates` updates run without the counting mode.
Variants:
  none       no EMA (the baseline for memory)
  ours       extensions.ema.EMA: trainable parameters only, one fused in-place lerp
  ours-bf16  the same with bf16 storage
  ours-masters  bf16 weights with the fp32 masters MasterWeightAdamW keeps (`model.param_dtype:
             bfloat16`): the fp32 EMA averages the masters
  composer   composer.algorithms.EMA's parameter copy and update (EMAParameters + compute_ema)
  naive      per parameter `e.copy_(e * s + p * (1 - s))`, the usual hand-written update
Prints a markdown table and PASS/FAIL against the targets (exit status 1 on a FAIL):
  extra peak memory of ours and ours-masters <= 1.05 x (4 bytes x trainable parameters)
  time per update of ours                    <= 0.2 x naive
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
VARIANTS = ["none", "ours", "ours-bf16", "ours-masters", "composer", "naive"]
MEMORY_TARGET = 1.05  # x (4 B x trainable parameters): one fp32 copy, and a little
TIME_TARGET = 0.2  # x naive


def _rss_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


class _LiveBytes:
    """Counts the bytes of tensor storages created while active, and their peak.

    A TorchDispatchMode sees every op's outputs; a storage counts from its first tensor until its
    last tensor is freed (refcount per storage), and storages that existed before (the model's
    weights, which in-place ops return) are never counted. Exact and independent of the allocator.
    """

    def __init__(self, preexisting):
        import weakref

        from compat.torch import TorchDispatchMode

        tracker = self
        self.known = {t.untyped_storage().data_ptr() for t in preexisting}
        self.refs: dict[int, list[int]] = {}  # storage ptr -> [live tensors, bytes]
        self.current = self.peak = 0

        def release(key):
            entry = tracker.refs[key]
            entry[0] -= 1
            if entry[0] == 0:
                tracker.current -= entry[1]
                del tracker.refs[key]

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                import torch

                out = func(*args, **(kwargs or {}))
                for t in out if isinstance(out, (list, tuple)) else [out]:
                    # A meta tensor (e.g. an empty_like(..., device="meta") for its strides) holds
                    # no memory, whatever its storage's nbytes says.
                    if not isinstance(t, torch.Tensor) or t.device.type == "meta":
                        continue
                    storage = t.untyped_storage()
                    key = storage.data_ptr()
                    if key in tracker.known:
                        continue
                    entry = tracker.refs.setdefault(key, [0, storage.nbytes()])
                    if entry[0] == 0:
                        tracker.current += entry[1]
                        tracker.peak = max(tracker.peak, tracker.current)
                    entry[0] += 1
                    weakref.finalize(t, release, key)
                return out

        self.mode = Mode()


def _build(model_name: str):
    import torch

    from models.components import build_components
    from models.registry import PRESETS

    if model_name == "tiny":  # the whole tiny StableDiffusion: frozen VAE and text encoder included
        from models import build_model

        return build_model("tiny")
    # An SD2-base-sized UNet, built on the meta device and filled, which is much faster than
    # diffusers' random init; the values do not matter for memory or time.
    from diffusers import UNet2DConditionModel

    assert model_name == "sd2-unet", model_name
    del build_components
    with torch.device("meta"):
        unet = UNet2DConditionModel(**PRESETS["sd2-base"]["unet"])
    unet = unet.to_empty(device="cpu")
    with torch.no_grad():
        for p in unet.parameters():
            p.normal_(0, 0.02)
    return unet


def _masters(trainable):
    """The trainable weights in bf16 and a MasterWeightAdamW holding their fp32 masters, as after a
    run's first step. Only the masters are made (`_init_state` would add AdamW's two fp32 moments,
    8 bytes a parameter the EMA never reads: 7 GB more on sd2's UNet)."""
    import torch

    from extensions.master_weights import MasterWeightAdamW

    optimizer = MasterWeightAdamW(trainable, lr=1e-4)
    with torch.no_grad():
        for p in trainable:
            master = p.data  # the fp32 weights become the master, as _init_state copies them
            p.data = master.to(torch.bfloat16)
            optimizer.state[p]["master"] = master
    return optimizer


def child(model_name: str, variant: str, updates: int) -> dict:
    """Runs in a subprocess: build the model, then time `updates` EMA updates."""
    import torch

    sys.path.insert(0, str(REPO))
    from extensions.ema import EMA

    model = _build(model_name)
    trainable = [p for p in model.parameters() if p.requires_grad]
    n_trainable = sum(p.numel() for p in trainable)
    stepped = trainable  # what the stand-in optimizer step changes
    optimizers = []
    if variant == "ours-masters":
        optimizers = [_masters(trainable)]
        stepped = [optimizers[0].state[p]["master"] for p in trainable]
    Path("/proc/self/clear_refs").write_text("5")  # reset the peak-RSS counter (VmHWM)
    rss_before = _rss_kib("VmRSS")
    smoothing = 0.999
    live = _LiveBytes(list(model.parameters()) + list(model.buffers()) + stepped)
    live.mode.__enter__()  # counts the set-up and the first update; timing runs without it

    if variant.startswith("ours"):
        ema = EMA(smoothing=smoothing, storage="bf16" if variant == "ours-bf16" else "fp32")
        ema._bind(model)
        ema.optimizers = optimizers  # as Composer's state.optimizers
        ema.step(0)  # allocate and initialise from the weights
        update = ema.step
    elif variant == "composer":
        from compat.composer import EMAParameters, compute_ema

        shadow = EMAParameters(model)

        def update(batch):
            compute_ema(model, shadow, smoothing)
    elif variant == "naive":
        shadow = [p.detach().clone() for p in trainable]

        def update(batch):
            with torch.no_grad():
                for e, p in zip(shadow, trainable):
                    e.copy_(e * smoothing + p * (1 - smoothing))
    else:

        def update(batch):
            pass

    times = []
    for batch in range(1, updates + 2):
        with torch.no_grad():  # stands in for the optimizer step, in place
            for p in stepped:
                p.add_(1e-4)
        start = time.perf_counter()
        update(batch)
        times.append(time.perf_counter() - start)
        if batch == 1:
            live.mode.__exit__(None, None, None)
            times.clear()
    return {
        "extra_peak_tensor_bytes": live.peak,
        "extra_peak_rss_bytes": (_rss_kib("VmHWM") - rss_before) * 1024,
        "update_s": statistics.median(times),
        "trainable": n_trainable,
    }


def run(model_name: str, updates: int) -> dict[str, dict]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    results = {}
    for variant in VARIANTS:
        out = subprocess.run(
            [sys.executable, __file__, "--child", model_name, variant, str(updates)],
            capture_output=True,
            text=True,
            check=True,
            env=env,
        ).stdout
        results[variant] = json.loads(out.strip().splitlines()[-1])
        print(f"  {model_name:9s} {variant:10s} done", file=sys.stderr)
    return results


def table(all_results: dict[str, dict[str, dict]]) -> tuple[str, list[str], bool]:
    """The markdown table, a PASS/FAIL line per target checked, and whether all passed."""
    lines = [
        "| model | variant | extra peak (tensors) | / (4 B x trainable) | extra peak RSS "
        "| time per update | / naive |",
        "|---|---|---|---|---|---|---|",
    ]
    verdicts = []
    for model_name, results in all_results.items():
        naive = results["naive"]["update_s"]
        fp32_copy = 4 * results["none"]["trainable"]
        rss_base = results["none"]["extra_peak_rss_bytes"]
        for variant in VARIANTS[1:]:
            r = results[variant]
            mem_ratio = r["extra_peak_tensor_bytes"] / fp32_copy
            time_ratio = r["update_s"] / naive
            rss = (r["extra_peak_rss_bytes"] - rss_base) / 2**20
            lines.append(
                f"| {model_name} ({r['trainable'] / 1e6:.1f}M trainable) | {variant} | "
                f"{r['extra_peak_tensor_bytes'] / 2**20:,.1f} MiB | {mem_ratio:.3f} | {rss:,.1f} MiB | "
                f"{r['update_s'] * 1e3:,.2f} ms | {time_ratio:.3f} |"
            )
            if variant in ("ours", "ours-masters"):
                verdict = "PASS" if mem_ratio <= MEMORY_TARGET else "FAIL"
                verdicts.append(
                    f"{verdict} {model_name} {variant}: extra peak memory {mem_ratio:.3f} x "
                    f"(4 B x trainable), target <= {MEMORY_TARGET}"
                )
            if variant == "ours":
                verdict = "PASS" if time_ratio <= TIME_TARGET else "FAIL"
                verdicts.append(
                    f"{verdict} {model_name} {variant}: time per update {time_ratio:.3f} x naive, "
                    f"target <= {TIME_TARGET}"
                )
    return "\n".join(lines), verdicts, all(v.startswith("PASS") for v in verdicts)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--models", nargs="+", default=["tiny", "sd2-unet"], choices=["tiny", "sd2-unet"])
    parser.add_argument("--updates", type=int, default=3, help="timed updates per variant (median)")
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        model_name, variant, updates = args.child
        print(json.dumps(child(model_name, variant, int(updates))))
        return 0
    all_results = {m: run(m, args.updates) for m in args.models}
    text, verdicts, ok = table(all_results)
    print(text + "\n")
    print("\n".join(verdicts))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
