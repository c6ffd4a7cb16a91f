"""The tiny recipe's first 20 losses against a committed trace, so that a change in numerics (the
noise, the loss, the data order, an initialisation, a library upgrade) shows up as one.

The trace is tests/golden/tiny-losses.json: yamls/tiny-cpu.yaml with the tests' overrides
(tests/conftest.py tiny_run: a random VAE, batch 16, the shared 64-image shapes set) on one CPU
thread. When numerics change on purpose, regenerate it and commit it with the change, saying why:

    GOLDEN_REGENERATE=1 OMP_NUM_THREADS=1 .venv/bin/pytest -p no:xdist tests/test_golden.py

Tolerance: 1e-4 relative per loss. Run to run on one machine the trace is bitwise identical; the
same run on 2 threads instead of 1 (other kernels' summation order, as another CPU would have)
moved losses by at most 1e-7 relative over the 20 batches. A change in numerics moves them by far
more than 1e-4: one batch's different noise or timesteps changes its loss by percents.
"""

import json
import math
import os
from pathlib import Path

import pytest
import torch

from extensions.callbacks import read_loss_log
from recipes import build_trainer, load_config
from tests.conftest import REPO, tiny_run

GOLDEN = Path(__file__).parent / "golden/tiny-losses.json"
BATCHES = 20
RTOL = 1e-4

pytestmark = pytest.mark.fit


def _losses(shapes_mds: Path, out: Path) -> list[float]:
    log = out / "loss.jsonl"
    overrides = [
        *tiny_run(shapes_mds, BATCHES),
        f"+callbacks.loss_log={{_target_: extensions.callbacks.LossLog, path: {log}}}",
    ]
    trainer = build_trainer(load_config(REPO / "yamls/tiny-cpu.yaml", overrides))
    trainer.fit()
    trainer.close()
    losses = read_loss_log(log)
    assert list(losses) == list(range(1, BATCHES + 1))
    return list(losses.values())


def test_first_losses_of_the_tiny_recipe_match_the_golden_trace(shapes_mds, tmp_path):
    losses = _losses(shapes_mds, tmp_path)
    if os.environ.get("GOLDEN_REGENERATE"):
        trace = {
            "recipe": "yamls/tiny-cpu.yaml",
            "overrides": "tests/conftest.py tiny_run(shapes_mds, 20)",
            "torch": torch.__version__,
            "losses": losses,
        }
        GOLDEN.write_text(json.dumps(trace, indent=1) + "\n")
        pytest.skip(f"regenerated {GOLDEN.relative_to(REPO)}: commit it with the change")
    golden = json.loads(GOLDEN.read_text())["losses"]
    assert len(golden) == BATCHES
    assert all(math.isfinite(x) for x in losses)
    assert losses == pytest.approx(golden, rel=RTOL, abs=0)
    # The trace is of a model that learns: the last five losses are below the first five.
    assert sum(golden[-5:]) < sum(golden[:5])
