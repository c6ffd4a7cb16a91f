"""`make gpu-check PRESET=flux-schnell` without a GPU (bench/gpu/depth_extrapolation.py): the per-block
line is exact for the full model's FLOPs, the job runs on a CPU with a tiny preset, and gpu_check runs
it as a job in its own process, reporting its row, its record for recipes.plan and the MFU anchor."""

import importlib.util
import json
import sys

import pytest
import torch

from models.flop_count import step_flops
from models.flops import training_flops_per_image
from tests.conftest import REPO

spec = importlib.util.spec_from_file_location("gpu_check", REPO / "bench/gpu/gpu_check.py")
gpu_check = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gpu_check)
depth = sys.modules["bench.gpu.depth_extrapolation"]
gpu_runs = sys.modules["bench.gpu.gpu_runs"]

# flux-tiny is 2 double + 4 single blocks: depths below it that separate the kinds, and a check.
TINY_DEPTHS = [{"num_layers": d, "num_single_layers": s} for d, s in ((1, 1), (2, 1), (1, 3), (2, 3))]


@pytest.mark.heavy
def test_the_full_models_flops_are_the_line_through_the_reduced_depths():
    """What makes the extrapolation fair, on the meta device: flux-schnell's training FLOPs at the
    depths gpu_check times lie on one line per block, and the line at 19 + 38 blocks is the full
    model's count (models/flops.py), which MFU divides by the extrapolated time."""
    preset, side = "flux-schnell", 256 // 8
    counts = [step_flops(depth.reduced_model(preset, d, "meta"), side, side) for d in gpu_check.FLUX_DEPTHS]
    full = {"num_layers": 19, "num_single_layers": 38}
    value, coefficients, residual = depth.extrapolate(gpu_check.FLUX_DEPTHS, counts, full)
    assert residual < 1e-9 and value == pytest.approx(training_flops_per_image(preset, 256), rel=1e-9)
    assert coefficients[1] > coefficients[2] > 0  # a double-stream block costs more than a single one


def test_depths_that_do_not_separate_the_kinds_are_refused():
    proportional = [{"num_layers": n, "num_single_layers": 2 * n} for n in (1, 2, 3)]
    with pytest.raises(ValueError, match="do not separate"):
        depth.fit(proportional, [1.0, 2.0, 3.0], ["num_layers", "num_single_layers"])


@pytest.mark.heavy
def test_the_job_trains_the_reduced_model_on_a_cpu():
    """flux-tiny at each depth: a real training step (loss, backward, AdamW) on precomputed encodings
    and the stored empty caption, its frozen encoders on the meta device; the record extrapolates to
    the preset's own depth."""
    record = depth.measure("flux-tiny", 32, 2, TINY_DEPTHS, steps=2, warmup=1, device="cpu")
    assert record["full_depth"] == {"num_layers": 2, "num_single_layers": 4}
    assert record["step_s"] > 0 and record["img_per_sec_per_gpu"] == pytest.approx(2 / record["step_s"])
    assert record["mfu"] is None and record["peak_memory_gb_unsharded"] is None  # no GPU: no peak
    sizes = [row["parameters"] for row in record["depths"]]
    assert sizes[0] < sizes[1] < sizes[3] and sizes[0] < sizes[2] < sizes[3]
    model = depth.reduced_model("flux-tiny", TINY_DEPTHS[0], "cpu")
    assert model.vae.encoder.conv_in.weight.is_meta and model.text_encoder_2.shared.weight.is_meta
    assert not model.transformer.x_embedder.weight.is_meta and model.caption_drop_prob == 0.1


@pytest.mark.subprocess
def test_gpu_check_runs_the_depth_job_in_its_own_process(monkeypatch, tmp_path):
    """`--preset flux-schnell` with its target made tiny (flux-tiny on the CPU): the job's process
    writes its record, the row reaches the table and the json, the best goes where recipes.plan reads
    it, and the MFU anchor's line is printed."""
    target = dict(
        gpu_check.TARGETS["flux-schnell"],
        microbatch={32: 2},
        depth=dict(preset="flux-tiny", depths=TINY_DEPTHS, device="cpu"),
    )
    monkeypatch.setitem(gpu_check.TARGETS, "flux-schnell", target)
    monkeypatch.setattr(gpu_check, "gpus", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "fake GPU")
    assert (
        gpu_check.main(["--preset", "flux-schnell", "--out", str(tmp_path), "--quick", "--budget", "0"]) == 0
    )
    report = json.loads((tmp_path / "gpu-check-flux-schnell.json").read_text())
    (row,) = report["rows"]
    assert (
        row["ok"] and row["variant"] == gpu_check.DEPTH_JOB and row["resolution"] == 32 and row["img_s"] > 0
    )
    record = json.loads((tmp_path / "depth-flux-tiny-32px.json").read_text())
    assert record["preset"] == "flux-tiny" and len(record["depths"]) == 4
    assert json.loads((tmp_path / "throughput-flux-schnell-32.json").read_text()) == record
    assert gpu_check.DEPTH_JOB in (tmp_path / "gpu-check-flux-schnell.md").read_text()


def test_the_flux_target_is_a_valid_job_plan():
    """The job fits one device call with room to rerun it, and its depths vary both kinds of block."""
    target = gpu_check.TARGETS["flux-schnell"]
    assert gpu_runs.estimate(("depth", gpu_check.DEPTH_JOB, 256), {}) * 2 <= gpu_check.BUDGET_S
    depth.fit(target["depth"]["depths"], [1.0, 2.0, 3.0, 4.0], ["num_layers", "num_single_layers"])
    largest = max(sum(d.values()) for d in target["depth"]["depths"])
    assert largest < 19 + 38 and target["microbatch"] == {256: 16}
