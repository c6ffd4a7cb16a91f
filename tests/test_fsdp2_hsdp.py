"""compat.torch.fsdp2_on_gloo: torch 2.7's FSDP2 averages gradients right over gloo, on a 1-D mesh and
on HSDP's 2-D one (tests/hsdp_worker.py, 4 CPU processes), and gloo still needs the shim."""

import json

import pytest

from tests.resume_check import composer_run

pytestmark = pytest.mark.subprocess


def test_hsdp_and_1d_gradients_equal_the_unsharded_models(tmp_path):
    result = composer_run(4, ["tests/hsdp_worker.py", str(tmp_path)], tmp_path)
    logs = "".join(p.read_text() for p in sorted(tmp_path.glob("r*.*")))
    assert result.returncode == 0, result.stderr[-3000:] + logs[-3000:]
    reports = [json.loads(p.read_text()) for p in sorted(tmp_path.glob("ok-rank*"))]
    assert len(reports) == 4
    # What the shim is for, as gloo did it without: the 1-D mesh summed 4 ranks' gradients.
    assert reports[0]["gloo_reduce_scatter_avg_gives"] == "4.000x"
    assert "AVG" in reports[0]["hsdp_without_shim"]
