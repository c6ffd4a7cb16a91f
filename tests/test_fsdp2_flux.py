"""Flux, Z-Image and FLUX.2 on the sharded path (issues 40 and 50, "2-process sharded training, kill and
resume as in the sharding issue"): `composer -n 2` of yamls/tiny-flux-cpu.yaml (tiny-zimage-cpu.yaml,
tiny-flux2-cpu.yaml) shards the transformer (FSDP2 over gloo), and a run SIGKILLed at a random moment
after its first checkpoint, rerun with the same command, ends bitwise equal to the uninterrupted run
(losses of every batch, final weights and EMA), as tests/test_fsdp2_train.py shows for the tiny MMDiT.
Each recipe's own parallelism: under 2 processes it shards over both (`shard:` is the launcher's
LOCAL_WORLD_SIZE) and writes a sharded checkpoint, one file per rank."""

import pytest

from tests.conftest import REPO
from tests.fsdp2_runs import BATCHES, COMMON
from tests.resume_check import (
    assert_same_run,
    kill_point,
    run,
    run_and_kill_at,
    train_command,
    train_env,
)

pytestmark = pytest.mark.slow


def _command(out, shapes_mds, recipe):
    # No parallelism override: each recipe shards over its launcher's LOCAL_WORLD_SIZE (its `shard:`).
    return train_command(2, out, shapes_mds, *COMMON, recipe=recipe)


@pytest.mark.parametrize("recipe", ["tiny-flux-cpu", "tiny-zimage-cpu", "tiny-flux2-cpu"])
def test_flux_sharded_sigkill_and_rerun_ends_bitwise_equal(recipe, shapes_mds, tmp_path):
    reference, resumed = tmp_path / "reference", tmp_path / "resumed"
    result = run(_command(reference, shapes_mds, recipe), REPO, train_env())
    assert result.returncode == 0, result.stderr[-3000:]
    assert "parallelism: FSDP2, the denoiser sharded over 2 CPU process(es) x 1 copy" in result.stderr
    last = max(p for p in (reference / "ckpt").iterdir() if p.is_dir() and not p.is_symlink())
    assert sorted(p.name for p in last.iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp"]

    kill_at, delay, why = kill_point(2, BATCHES - 2)
    command = _command(resumed, shapes_mds, recipe)
    run_and_kill_at(command, REPO, train_env(), resumed / "loss.jsonl", kill_at, delay)
    again = run(command, REPO, train_env())
    assert again.returncode == 0, f"{why}: " + again.stderr[-3000:]
    assert "the newest complete checkpoint" in again.stderr, why
    assert_same_run(reference, resumed, why, BATCHES)
