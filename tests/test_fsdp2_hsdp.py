"""torch's FSDP2 averages gradients right over gloo, on a 1-D mesh and on HSDP's 2-D one
(tests/hsdp_worker.py, 4 CPU processes): what the CPU tests of sharding rely on. torch 2.7 needed a
shim for both (gone with torch 2.14)."""

import json

import pytest

from tests.resume_check import composer_run

pytestmark = pytest.mark.subprocess


def test_hsdp_and_1d_gradients_equal_the_unsharded_models(tmp_path):
    result = composer_run(4, ["tests/hsdp_worker.py", str(tmp_path)], tmp_path)
    logs = "".join(p.read_text() for p in sorted(tmp_path.glob("r*.*")))
    assert result.returncode == 0, result.stderr[-3000:] + logs[-3000:]
    reports = [json.loads(p.read_text()) for p in sorted(tmp_path.glob("ok-rank*"))]
    assert len(reports) == 4 and set(reports[0]["step_s"]) == {"1-D", "HSDP"}
