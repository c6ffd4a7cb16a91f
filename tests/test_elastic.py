"""Elastic determinism: one global batch size on 1 process and on `composer -n 2` trains on the same
samples in the same global order (data.train.num_canonical_nodes fixed), across an epoch boundary.
Read from the shared reference runs' sample-key logs (tests.probes.KeyLog)."""

import pytest

from tests.probes import read_key_log
from tests.resume_check import BATCHES

pytestmark = pytest.mark.slow
GLOBAL_BATCH, EPOCH = 16, 4  # 64 samples: batches 5-8 are epoch 2's reshuffle


def test_one_and_two_processes_see_the_same_global_batches(reference_run):
    one = read_key_log(reference_run(1) / "keys.jsonl")
    two = read_key_log(reference_run(2) / "keys.jsonl")

    assert sorted(one) == sorted(two) == list(range(1, BATCHES + 1))
    for batch in one:
        assert len(one[batch]) == len(set(one[batch])) == GLOBAL_BATCH
        assert len(two[batch]) == len(set(two[batch])) == GLOBAL_BATCH  # the ranks' halves do not overlap
    # Within a global batch the two ranks' halves are concatenated, so compare each batch as a set;
    # the sequence of sets is the global order.
    assert [set(one[b]) for b in one] == [set(two[b]) for b in one]
    # The run is long enough to say something: epoch 1 covers the dataset once, and epoch 2 reshuffles.
    epoch1 = [k for b in range(1, EPOCH + 1) for k in one[b]]
    assert len(set(epoch1)) == 64
    assert [set(one[b]) for b in (1, 2)] != [set(one[b]) for b in (EPOCH + 1, EPOCH + 2)]
