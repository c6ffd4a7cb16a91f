"""What torch.profiler saw over a few training steps, in a few numbers (bench/throughput.py --profile,
bench/gpu/gpu_check.py's plain loop; gpu-check writes one JSON per variant beside its table).

    {"steps": 3, "wall_ms_per_step": 181.2,
     "gpu_busy_fraction": 0.58,       # union of the GPU's kernel, memcpy and memset intervals / wall
     "gpu_ms_per_step": 105.1,         # that union per step (null, like the fraction, without GPU events)
     "kernels_per_step": 2496.0,       # kernels the GPU ran (CUDA-graph launched ones too)
     "kernel_launches_per_step": 2496.0,  # the host's launch calls: cudaLaunchKernel(ExC), cuLaunchKernel(Ex)
     "cuda_graph_launches_per_step": 0.0,  # cudaGraphLaunch: each runs a whole graph of kernels
     "host_syncs_per_step": 7.0,       # cuda(Stream|Device|Event)Synchronize, cudaMemcpy (blocking)
     "bench_syncs_per_step": 1.0,      # the same, inside the bench's own `bench::` ranges: not counted above
     "local_scalar_dense_per_step": 6.0,  # aten::_local_scalar_dense: .item() and friends, on any device
     "memcpy_dtoh_per_step": 6.0, "aten_ops_per_step": 9100.0,
     "top_kernels": [{"name": ..., "calls": 96, "total_ms": 31.5, "percent": 10.0}, ...],  # of GPU time
     "note": ...}                      # present when something reads differently, e.g. no GPU events

`summarise` takes Chrome-trace-like dicts (name, cat, ts and dur in microseconds, as
`export_chrome_trace` writes them), so a synthetic list tests it; `events_from_profiler` makes them
from a torch.profiler run. Under the profiler the host runs slower (it records every op), so the
wall time and GPU-busy fraction here are the profiled steps', not the timed ones'.
"""

import json
import re
import time
from pathlib import Path

import torch

DEVICE_CATEGORIES = {"kernel", "gpu_memcpy", "gpu_memset"}
LAUNCHES = {"cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx",
            "cudaLaunchCooperativeKernel", "cudaLaunchCooperativeKernelMultiDevice"}  # fmt: skip
GRAPH_LAUNCHES = {"cudaGraphLaunch", "cuGraphLaunch"}
SYNCS = {"cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy",
         "cuStreamSynchronize", "cuCtxSynchronize", "cuEventSynchronize"}  # fmt: skip
BENCH_MARK = "bench::"  # record_function ranges of the benchmark itself (its clock's synchronize)
TOP = 10


def _api(name: str) -> str:
    return re.sub(r"_v\d+$", "", name)  # CUPTI may suffix an API version: cudaLaunchKernel_v7000


def events_from_profiler(prof) -> list[dict]:
    """A finished torch.profiler.profile's events as dicts {name, cat, ts, dur} (microseconds)."""
    events = []
    for event in prof.events():
        on_gpu = event.device_type == torch.autograd.DeviceType.CUDA
        if getattr(event, "is_user_annotation", False):
            cat = "gpu_user_annotation" if on_gpu else "user_annotation"
        elif on_gpu:
            cat = {"Memcpy": "gpu_memcpy", "Memset": "gpu_memset"}.get(event.name[:6], "kernel")
        elif _api(event.name) in LAUNCHES | GRAPH_LAUNCHES | SYNCS or event.name.startswith("cuda"):
            cat = "cuda_runtime"
        else:
            cat = "cpu_op"
        start = event.time_range.start
        events.append({"name": event.name, "cat": cat, "ts": start, "dur": event.time_range.end - start})
    return events


def _union_us(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for start, stop in sorted(intervals):
        if stop > end:
            total += stop - max(start, end)
            end = stop
    return total


def summarise(events: list[dict], steps: int, wall_ms: float | None = None) -> dict:
    """The numbers above from `steps` profiled steps; `wall_ms`: their wall time (default: the span
    of the events)."""
    if steps < 1:
        raise ValueError("steps must be at least 1")
    if wall_ms is None:
        wall_ms = (
            (max(e["ts"] + e["dur"] for e in events) - min(e["ts"] for e in events)) / 1000 if events else 0
        )
    device = [e for e in events if e.get("cat") in DEVICE_CATEGORIES]
    host = [e for e in events if e.get("cat") not in DEVICE_CATEGORIES | {"gpu_user_annotation"}]
    marks = [(e["ts"], e["ts"] + e["dur"]) for e in host if e["name"].startswith(BENCH_MARK)]
    syncs = [e for e in host if _api(e["name"]) in SYNCS]
    ours = [e for e in syncs if any(start <= e["ts"] <= stop for start, stop in marks)]

    def per_step(count: float) -> float:
        return round(count / steps, 1)

    busy_ms = _union_us([(e["ts"], e["ts"] + e["dur"]) for e in device]) / 1000 if device else None
    summary = {
        "steps": steps,
        "wall_ms_per_step": round(wall_ms / steps, 3),
        "gpu_busy_fraction": round(busy_ms / wall_ms, 4) if busy_ms is not None and wall_ms > 0 else None,
        "gpu_ms_per_step": round(busy_ms / steps, 3) if busy_ms is not None else None,
        "kernels_per_step": per_step(sum(e["cat"] == "kernel" for e in device)),
        "kernel_launches_per_step": per_step(sum(_api(e["name"]) in LAUNCHES for e in host)),
        "cuda_graph_launches_per_step": per_step(sum(_api(e["name"]) in GRAPH_LAUNCHES for e in host)),
        "host_syncs_per_step": per_step(len(syncs) - len(ours)),
        "bench_syncs_per_step": per_step(len(ours)),
        "local_scalar_dense_per_step": per_step(sum(e["name"] == "aten::_local_scalar_dense" for e in host)),
        "memcpy_dtoh_per_step": per_step(sum(e["name"].startswith("Memcpy DtoH") for e in device)),
        "aten_ops_per_step": per_step(sum(e["name"].startswith("aten::") for e in host)),
        "top_kernels": _top(device),
    }
    if not device:
        summary["note"] = (
            "no GPU activity in the profile (a CPU-only run, or CUDA not traced): GPU-busy is null, and "
            "kernel launches and host syncs count CUDA calls, so they are 0"
        )
    elif summary["kernel_launches_per_step"] == 0 and summary["cuda_graph_launches_per_step"] == 0:
        summary["note"] = "GPU kernels without launch calls: the CUDA runtime's calls were not traced"
    return summary


def _top(device: list[dict]) -> list[dict]:
    total_us = sum(e["dur"] for e in device)
    by_name: dict[str, list[float]] = {}
    for e in device:
        calls_time = by_name.setdefault(e["name"], [0, 0.0])
        calls_time[0] += 1
        calls_time[1] += e["dur"]
    ranked = sorted(by_name.items(), key=lambda item: -item[1][1])[:TOP]
    return [
        {"name": name[:200], "calls": calls, "total_ms": round(us / 1000, 3),
         "percent": round(100 * us / total_us, 2) if total_us else 0.0}
        for name, (calls, us) in ranked
    ]  # fmt: skip


def one_line(summary: dict) -> str:
    """GPU busy, launches and syncs per step, for gpu-check's log."""
    busy = summary["gpu_busy_fraction"]
    busy = f"GPU busy {busy:.0%}" if busy is not None else "GPU busy n/a (no GPU events)"
    return (
        f"{busy} of {summary['wall_ms_per_step']:.1f} ms/step, "
        f"{summary['kernel_launches_per_step']:,g} kernel launches + "
        f"{summary['cuda_graph_launches_per_step']:,g} graph launches/step, "
        f"{summary['host_syncs_per_step']:g} host syncs/step"
    )


class StepProfile:
    """torch.profiler (CPU, and CUDA where there is one) from `start()` to `stop()` over `steps`
    steps; synchronises the GPU at both ends so the wall time holds the window's GPU work (the end's
    synchronize inside a `bench::` range, so it is not counted as the steps' host sync)."""

    def __init__(self, steps: int):
        self.steps, self.prof, self.wall_ms, self._start = steps, None, None, 0.0

    def start(self) -> None:
        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
            torch.cuda.synchronize()
        self.prof = torch.profiler.profile(activities=activities)
        self.prof.start()
        self._start = time.perf_counter()

    def stop(self) -> None:
        if torch.cuda.is_available():  # recorded (the profiler is on): marked as the bench's, not the step's
            with torch.profiler.record_function(f"{BENCH_MARK}profile-stop"):
                torch.cuda.synchronize()
        self.wall_ms = 1000 * (time.perf_counter() - self._start)
        self.prof.stop()

    def summary(self) -> dict:
        if self.prof is None or self.wall_ms is None:
            raise RuntimeError("the profiled steps did not run")
        return summarise(events_from_profiler(self.prof), self.steps, self.wall_ms)


def write(path: str | Path, summary: dict, **context) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps({**context, **summary}, indent=1) + "\n")
