"""Elastic determinism: one global batch size on 1 process and on `composer -n 2` trains on the same
samples in the same global order (data.train.num_canonical_nodes fixed), across an epoch boundary."""

import os
import sys

import pytest

from tests.conftest import REPO
from tests.probes import read_key_log
from tests.resume_check import run

pytestmark = pytest.mark.slow
GLOBAL_BATCH, BATCHES = 16, 6  # 64 samples: 4 batches an epoch, so batches 5-6 are epoch 2's reshuffle


def _keys_seen(nproc: int, out, shapes_mds) -> dict[int, list[str]]:
    launcher = [sys.executable] if nproc == 1 else [str(REPO / ".venv/bin/composer"), "-n", str(nproc)]
    command = [
        *launcher,
        "tests/dist_train.py",
        str(out),
        "yamls/tiny-cpu.yaml",
        f"data.train.local={shapes_mds / 'mds'}",
        "~data.train.prepare",
        "data.train.num_canonical_nodes=2",
        "model.pretrained=null",
        f"global_train_batch_size={GLOBAL_BATCH}",
        f"trainer.max_duration={BATCHES}ba",
        "trainer.autoresume=false",
        f"trainer.save_folder={out / 'ckpt'}",
        "trainer.save_interval=1000ba",
        "trainer.progress_bar=false",
        f"+callbacks.key_log={{_target_: tests.probes.KeyLog, path: {out / 'keys.jsonl'}}}",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline", "PYTHONPATH": str(REPO)}
    done = run(command, REPO, env)
    assert done.returncode == 0, done.stderr[-3000:]
    return read_key_log(out / "keys.jsonl")


def test_one_and_two_processes_see_the_same_global_batches(shapes_mds, tmp_path):
    one = _keys_seen(1, tmp_path / "one", shapes_mds)
    two = _keys_seen(2, tmp_path / "two", shapes_mds)

    assert sorted(one) == sorted(two) == list(range(1, BATCHES + 1))
    for batch in one:
        assert len(one[batch]) == len(set(one[batch])) == GLOBAL_BATCH
        assert len(two[batch]) == len(set(two[batch])) == GLOBAL_BATCH  # the ranks' halves do not overlap
    # Within a global batch the two ranks' halves are concatenated, so compare each batch as a set;
    # the sequence of sets is the global order.
    assert [set(one[b]) for b in one] == [set(two[b]) for b in one]
    # The run is long enough to say something: epoch 1 covers the dataset once, and epoch 2 reshuffles.
    epoch1 = [k for b in range(1, 5) for k in one[b]]
    assert len(set(epoch1)) == 64
    assert [set(one[b]) for b in (1, 2)] != [set(one[b]) for b in (5, 6)]
