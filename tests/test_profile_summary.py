"""bench/profile_summary.py: the numbers gpu-check prints per variant (GPU busy, launches and host
syncs per step, top kernels), from a synthetic event list whose answer is known and from real
torch.profiler runs on the CPU, where there are no GPU events and the summary must say so."""

import json
import runpy
import sys

import pytest
import torch

from bench import profile_summary
from tests.conftest import REPO


def ev(name, cat, ts, dur):
    return {"name": name, "cat": cat, "ts": ts, "dur": dur}


def synthetic_two_steps() -> list[dict]:
    """Two steps in 1,000 us: kernels on two streams (overlapping), a DtoH copy, launches through
    the runtime and the driver (Triton's), a graph launch, three syncs of which one is the bench's."""
    return [
        ev("aten::mm", "cpu_op", 0, 50),
        ev("cudaLaunchKernel", "cuda_runtime", 10, 5),
        ev("cudaLaunchKernel_v7000", "cuda_runtime", 20, 5),  # CUPTI's versioned name
        ev("cuLaunchKernelEx", "cuda_driver", 30, 5),
        ev("cudaGraphLaunch", "cuda_runtime", 40, 5),
        ev("aten::_local_scalar_dense", "cpu_op", 60, 100),
        ev("cudaStreamSynchronize", "cuda_runtime", 70, 80),
        ev("cudaDeviceSynchronize", "cuda_runtime", 400, 10),
        ev("bench::clock", "user_annotation", 900, 50),
        ev("cudaDeviceSynchronize", "cuda_runtime", 910, 30),  # the bench's clock: not the step's
        ev("bench::clock", "gpu_user_annotation", 900, 50),  # a range, not GPU work
        ev("gemm", "kernel", 100, 200),  # stream 7: 100-300
        ev("gemm", "kernel", 300, 200),  # 300-500
        ev("norm", "kernel", 250, 100),  # stream 8: 250-350, inside the union already
        ev("Memcpy DtoH (Device -> Pageable)", "gpu_memcpy", 600, 20),
        ev("add", "kernel", 700, 30),
    ]


def test_summary_of_a_known_event_list():
    s = profile_summary.summarise(synthetic_two_steps(), steps=2, wall_ms=1.0)
    assert s["steps"] == 2 and s["wall_ms_per_step"] == 0.5
    assert s["gpu_busy_fraction"] == pytest.approx((400 + 20 + 30) / 1000)  # union: 100-500, 600-620, 700-730
    assert s["gpu_ms_per_step"] == pytest.approx(0.225)
    assert s["kernels_per_step"] == 2.0  # 4 kernels; the memcpy and the annotation are not kernels
    assert s["kernel_launches_per_step"] == 1.5 and s["cuda_graph_launches_per_step"] == 0.5
    assert s["host_syncs_per_step"] == 1.0 and s["bench_syncs_per_step"] == 0.5
    assert s["local_scalar_dense_per_step"] == 0.5 and s["memcpy_dtoh_per_step"] == 0.5
    assert s["aten_ops_per_step"] == 1.0 and "note" not in s
    top = s["top_kernels"]
    assert [k["name"] for k in top] == ["gemm", "norm", "add", "Memcpy DtoH (Device -> Pageable)"]
    assert top[0] == {"name": "gemm", "calls": 2, "total_ms": 0.4, "percent": pytest.approx(72.73)}
    assert sum(k["percent"] for k in top) == pytest.approx(100, abs=0.05)
    line = profile_summary.one_line(s)
    assert (
        line
        == "GPU busy 45% of 0.5 ms/step, 1.5 kernel launches + 0.5 graph launches/step, 1 host syncs/step"
    )


def test_wall_defaults_to_the_events_span_and_top_keeps_ten():
    events = [ev(f"k{i}", "kernel", 10 * i, 10 + i) for i in range(12)]  # overlapping, 0..131 us
    s = profile_summary.summarise(events, steps=1)
    assert s["wall_ms_per_step"] == pytest.approx(0.131)
    assert len(s["top_kernels"]) == 10 and s["top_kernels"][0]["name"] == "k11"
    with pytest.raises(ValueError):
        profile_summary.summarise(events, steps=0)


def test_gpu_events_without_launch_calls_are_flagged():
    s = profile_summary.summarise([ev("gemm", "kernel", 0, 10)], steps=1, wall_ms=0.02)
    assert s["gpu_busy_fraction"] == 0.5 and "not traced" in s["note"]


def test_a_real_cpu_profile_reports_no_gpu_cleanly(tmp_path):
    """A tiny model's training steps under torch.profiler on the CPU: no GPU events, so GPU-busy is
    null and launches and syncs 0, said in a note; the host-side counts are real."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.SiLU(), torch.nn.Linear(16, 1))
    optimizer = torch.optim.AdamW(model.parameters(), fused=True)
    window = profile_summary.StepProfile(steps=2)
    window.start()
    for _ in range(2):
        loss = model(torch.randn(4, 8)).square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        loss.item()  # a host read: aten::_local_scalar_dense
    window.stop()
    s = window.summary()
    assert s["steps"] == 2 and s["wall_ms_per_step"] > 0
    assert s["gpu_busy_fraction"] is None and s["gpu_ms_per_step"] is None and s["top_kernels"] == []
    assert s["kernels_per_step"] == s["kernel_launches_per_step"] == s["host_syncs_per_step"] == 0
    assert s["local_scalar_dense_per_step"] >= 1 and s["aten_ops_per_step"] > 10
    assert "no GPU activity" in s["note"]
    assert profile_summary.one_line(s).startswith("GPU busy n/a (no GPU events)")
    profile_summary.write(tmp_path / "p.json", s, variant="tiny")
    assert json.loads((tmp_path / "p.json").read_text()) == {"variant": "tiny", **s}


def test_the_windows_closing_synchronize_is_the_benchs(monkeypatch):
    """StepProfile.stop() synchronises the GPU while the profiler still records: that sync is the
    bench's (inside a `bench::` range), not the steps'. CUDA's synchronize is a stand-in here that the
    profiler records under the runtime call's name."""
    window = profile_summary.StepProfile(steps=2)
    window.start()
    torch.ones(4).sum()

    def synchronize():
        with torch.profiler.record_function("cudaDeviceSynchronize"):
            pass

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "synchronize", synchronize)
    window.stop()
    s = window.summary()
    assert s["host_syncs_per_step"] == 0 and s["bench_syncs_per_step"] == 0.5


def test_summary_before_the_window_ran_is_an_error():
    with pytest.raises(RuntimeError, match="did not run"):
        profile_summary.StepProfile(3).summary()


@pytest.mark.fit
def test_throughput_profiles_batches_after_the_timed_ones(shapes_mds, tmp_path, monkeypatch):
    """bench/throughput.py --profile: the tiny recipe on the CPU trains warm-up + timed + profiled
    batches, times only the timed ones and writes the profile's summary beside the result."""
    out, profile = tmp_path / "throughput.json", tmp_path / "profile.json"
    overrides = [
        "model.preset=tiny", "~model.pretrained_components", "~model.low_precision_norms",
        "global_train_batch_size=4", "trainer.device_train_microbatch_size=4", "data.train.resolution=32",
        "data.train.num_workers=0", "data.train.num_canonical_nodes=1", "trainer.device=cpu",
        "trainer.precision=fp32", "callbacks.memory_monitor=null", "_step=eager",
    ]  # fmt: skip
    args = [str(REPO / "yamls/sd2-base.yaml"), *overrides, "--batches", "2", "--warmup", "1"]
    args += ["--out", str(out), "--data", str(shapes_mds / "mds"), "--profile", str(profile)]
    args += ["--profile-steps", "2"]
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setattr(sys, "argv", ["bench/throughput.py", *args])
    runpy.run_path(str(REPO / "bench/throughput.py"), run_name="__main__")
    record, summary = json.loads(out.read_text()), json.loads(profile.read_text())
    assert record["timed_batches"] == 2 and "profile" not in record
    assert summary["steps"] == 2 and summary["resolution"] == 32 and summary["gpu_busy_fraction"] is None
    assert summary["aten_ops_per_step"] > 100 and summary["wall_ms_per_step"] > 0
