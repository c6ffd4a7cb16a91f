"""`python -m recipes.plan` on a run to an MLPerf quality target: priced at MLPerf's samples to converge
(recipes/convergence.py, the RCPs of its Flux.1 benchmark) and a measured throughput, per GPU count."""

import json
import re

import numpy as np
import pytest

from recipes.config import ConfigError
from recipes.convergence import FLUX1, benchmark_of
from recipes.plan import main
from tests.conftest import REPO

MLPERF = REPO / "yamls/flux-schnell-mlperf.yaml"
RATE = 15.0  # img/s per GPU: about a GB200's in NVIDIA's MLPerf v5.1 logs (the issue's figure)


def _plan(capsys, *args) -> list[dict]:
    main([str(MLPERF), "--img-per-sec-per-gpu", str(RATE), "--json", *args])
    return json.loads(capsys.readouterr().out)


def test_the_reference_points_are_mlperf_s_published_runs():
    """20 runs per global batch, each converged at a validation (every 262,144 samples: the run can only
    stop there), and the olympic means the issue quotes: 7.24 M at 512 and 15.35 M at 4,096 are the
    plain means of the same runs, the RCP checker's means leave out the fastest and the slowest."""
    assert [p.global_batch for p in FLUX1.points] == [512, 1024, 2048, 4096]
    for point in FLUX1.points:
        assert len(point.samples) == 20
        assert all(s % FLUX1.eval_every == 0 for s in point.samples), point.global_batch
    assert np.mean(FLUX1.points[0].samples) == pytest.approx(7.24e6, abs=0.005e6)
    assert np.mean(FLUX1.points[-1].samples) == pytest.approx(15.35e6, abs=0.005e6)
    assert FLUX1.samples_to_converge(512) == pytest.approx(7.22e6, abs=0.005e6)
    assert FLUX1.samples_to_converge(4096) == pytest.approx(15.38e6, abs=0.005e6)


def test_samples_to_converge_between_and_outside_the_points():
    at = FLUX1.samples_to_converge
    assert at(768) == round((FLUX1.points[0].mean + FLUX1.points[1].mean) / 2)  # the line between
    batches = [512, 768, 1024, 1536, 2048, 3072, 4096]
    assert [at(b) for b in batches] == sorted(at(b) for b in batches)  # a larger batch needs more samples
    for batch in (256, 8192):
        with pytest.raises(ConfigError, match=f"global batch {batch} is outside .* 512..4096") as err:
            at(batch)
        assert "\n" not in str(err.value)


@pytest.mark.heavy
def test_the_mlperf_recipe_is_priced_from_the_reference_runs_at_its_batch(capsys):
    """yamls/flux-schnell-mlperf.yaml on 8..256 GPUs: every row trains its global batch of 1024 to the
    target, 8.49 M samples (not max_duration's 30.7 M), and the days follow from the measured rate."""
    rows = _plan(capsys, "--gpus", "8", "64", "256")
    samples = FLUX1.samples_to_converge(1024)
    assert samples == pytest.approx(8.49e6, abs=0.005e6)
    for row in rows:
        assert "error" not in row and row["per_device_batch"] * row["gpus"] == 1024
        assert row["images"] == samples
        assert row["days"] == pytest.approx(samples / (RATE * row["gpus"]) / 86400)
    # Sharded over a node: an eighth of the ~190 GB of training state per GPU, ~20 GB of frozen encoders.
    assert all(m["fits"] and m["shard"] == 8 for row in rows for m in row["memory"])
    # By hand: 8,490,553 samples / (15 img/s x 64 GPUs) = 8,844 s = 2 h 27 min.
    assert rows[1]["days"] * 24 * 60 == pytest.approx(147.4, abs=0.05)


@pytest.mark.heavy
def test_the_table_says_where_the_samples_come_from_and_the_time_to_train(capsys):
    main([str(MLPERF), "--img-per-sec-per-gpu", str(RATE), "--gpus", "64", "256"])
    out = capsys.readouterr().out
    assert out.startswith(
        f"{MLPERF}: preset flux-schnell, global batch 1024, to MLPerf Flux.1's target 0.586 "
    )
    assert "rcps_flux1.json: the olympic mean of 20 reference runs" in out
    assert "trainer.max_duration 30000ba is only a cap" in out
    minutes = [round(FLUX1.samples_to_converge(1024) / (RATE * n) / 60) for n in (64, 256)]
    expected = ", ".join(f"{n} GPUs {m // 60}:{m % 60:02d}" for n, m in zip((64, 256), minutes))
    assert f"time to train (hours:minutes): {expected}" in out
    assert "note: at global batch" not in out  # the recipe's lr and warmup are the RCP's at 1024


def test_per_gpu_batch_prices_each_count_at_its_own_batch(capsys):
    """MLPerf's way of scaling out: 16 per GPU, so 32 GPUs train at 512 and 256 at 4096, each priced at
    its batch's reference runs; 8 and 16 GPUs (128, 256) have none: error rows, exit status 1. A batch
    whose reference runs trained with another lr or warmup than the recipe's is noted."""
    with pytest.raises(SystemExit) as exit_:
        main([str(MLPERF), "--img-per-sec-per-gpu", str(RATE), "--per-gpu-batch", "16"])
    assert exit_.value.code == 1
    out = capsys.readouterr().out
    table = {line.split()[0]: line.split() for line in out.split("\n\n")[1].splitlines()[1:]}
    for gpus, point in zip(("32", "64", "128", "256"), FLUX1.points, strict=True):
        assert table[gpus][1] == "16" and table[gpus][4] == f"{round(point.mean):,}"
    assert table["8"][3] == table["16"][3] == "error"
    assert "error at 8 GPUs: global batch 128 is outside the MLPerf Flux.1 reference runs' 512..4096" in out
    noted = re.findall(r"note: at global batch (\d+) the reference runs trained with ", out)
    assert noted == ["512", "2048", "4096"]
    assert "optimizer.lr=0.0002 scheduler.t_warmup=1600ba" in out


@pytest.mark.heavy
def test_a_run_without_the_target_is_priced_by_max_duration(capsys):
    """Without the quality target (or at another resolution) the reference runs do not apply: the
    planner prices max_duration as for any recipe, and --per-gpu-batch is a one-line config error."""
    (row,) = _plan(capsys, "--gpus", "64", "callbacks.quality_target.target=null")
    assert row["images"] == 30000 * 1024
    (row,) = _plan(capsys, "--gpus", "64", "data.train.resolution=512")
    assert row["images"] == 30000 * 1024
    with pytest.raises(SystemExit) as exit_:
        main([str(REPO / "yamls/sd3-medium.yaml"), "--img-per-sec-per-gpu", "50", "--per-gpu-batch", "16"])
    assert str(exit_.value.code).startswith("config error: --per-gpu-batch: ")
    assert "no MLPerf target: MLPerf Flux.1's is model.preset flux-schnell" in str(exit_.value.code)


def test_benchmark_of_reads_the_run_s_quality_target():
    from recipes import load_config, parse_config

    given = ["model.pretrained=/m", "data.train.remote=s3://b/t", "data.eval.remote=s3://b/e"]
    run = parse_config(load_config(MLPERF, [*given, "trainer.save_folder=/c"]))
    assert benchmark_of(run) is FLUX1
    run = parse_config(load_config(MLPERF, [*given, "trainer.save_folder=/c", "model.eval_timesteps=null"]))
    assert benchmark_of(run) is None
