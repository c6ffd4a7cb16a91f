"""`data.train.holdout`: samples of the training set kept out of training, to measure a held-out loss.

Which samples: the `count` global sample indices (a StreamingDataset numbers its samples 0 .. N - 1
over its streams in order, the same on every rank) with the smallest key, where a sample's key is a
fixed bijective 64-bit mix of its index and SALT (splitmix64's finaliser). The keys are distinct, so
the selection is exactly `count` samples, a function of (N, count) alone: the same on every rerun,
with any number of processes, nodes or DataLoader workers, and it never changes unless the set does.
A fraction f holds out max(1, round(f * N)) samples. The selection is computed in chunks keeping only
the candidates below a bound a little above the f quantile, so memory is about the held-out set's,
not the whole set's.

Training leaves them out: `leave_out` makes a StreamingBase drop them from every epoch's sample ids
(its `resample_streams`, which every batching method of streaming goes through) and shrinks its
epoch. That needs each held-out sample to appear a fixed number of times an epoch (no `proportion`
or `choose`, a whole `repeat`), which data/streams.py checks. Evaluation reads them through
`HeldOut`, a map-style view of the training dataset (its cache and downloads too), unaugmented.
"""

import logging
import math

import numpy as np
import torch

log = logging.getLogger(__name__)

SALT = 0x5D1E_7A1D_0BE5_7C0D  # changing it changes every run's split
_GOLDEN, _MIX1, _MIX2 = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB
CHUNK = 1 << 22  # indices keyed at a time (32 MB of keys)


def check_holdout(value) -> None:
    """A holdout a set could have: a fraction 0 < f < 1 or a whole number of samples >= 1."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(
            f"holdout must be a fraction of the set (0 < f < 1) or a whole number of samples, got {value!r}"
        )
    if value <= 0:
        raise ValueError(
            f"holdout={value!r} must be more than 0: a fraction of the set (0 < f < 1, e.g. 0.01) or a "
            "number of samples (e.g. 500); null keeps none out"
        )
    if isinstance(value, float) and value >= 1:
        raise ValueError(
            f"holdout={value!r} is a fraction of 1 or more, which leaves nothing to train on; give a "
            "fraction below 1 (e.g. 0.01) or a whole number of samples (e.g. 500)"
        )


def holdout_count(holdout: float | int, total: int, key: str = "data.train.holdout") -> int:
    """How many of `total` samples `holdout` keeps out; ValueError when that leaves none to train on."""
    count = holdout if isinstance(holdout, int) else max(1, round(holdout * total))
    if count >= total:
        raise ValueError(
            f"{key}={holdout!r} holds out {count} of the set's {total} samples, leaving none to train "
            "on; hold out fewer (e.g. a fraction such as 0.1) or add samples"
        )
    return count


def _keys(start: int, stop: int) -> np.ndarray:
    """The keys of indices start .. stop - 1: a bijection of uint64, so no two indices share one."""
    with np.errstate(over="ignore"):
        z = np.arange(start, stop, dtype=np.uint64) + np.uint64(SALT) + np.uint64(_GOLDEN)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(_MIX1)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(_MIX2)
        return z ^ (z >> np.uint64(31))


def held_out_ids(total: int, holdout: float | int) -> np.ndarray:
    """The sorted global indices (int64) of the samples `holdout` keeps out of `total`."""
    count = holdout_count(holdout, total)
    share = count / total
    # The keys are uniform over 2^64, so the `count` smallest lie below about `share` of the range:
    # keep the candidates under a bound 8 standard deviations above it, widening in the (never seen)
    # case that too few fall below. The result does not depend on the bound, only the memory does.
    bound = share + 8 * math.sqrt(share * (1 - share) / total) + 16 / total
    while True:
        limit = np.uint64(min(2**64 - 1, int(min(bound, 1.0) * 2**64)))
        ids, keys = [], []
        for start in range(0, total, CHUNK):
            chunk = _keys(start, min(total, start + CHUNK))
            below = np.flatnonzero(chunk < limit)
            ids.append(below + start)
            keys.append(chunk[below])
        ids, keys = np.concatenate(ids), np.concatenate(keys)
        if len(ids) >= count or bound >= 1.0:
            break
        bound *= 2
    smallest = np.argpartition(keys, count - 1)[:count] if count < len(ids) else slice(None)
    return np.sort(ids[smallest]).astype(np.int64)


def held_per_stream(sizes: list[int], holdout: float | int) -> list[int]:
    """How many held-out samples fall in each stream of `sizes` samples (streams numbered in order)."""
    held = held_out_ids(sum(sizes), holdout)
    edges = np.searchsorted(held, np.cumsum([0, *sizes]))
    return np.diff(edges).tolist()


def _is_held(ids: np.ndarray, held: np.ndarray) -> np.ndarray:
    at = np.minimum(np.searchsorted(held, ids), len(held) - 1)
    return held[at] == ids


def without_held(units: np.ndarray, ids: np.ndarray, held: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """streaming's resampled epoch (`shuffle_units`: consecutive spans of `ids`, one per shard and
    repeat) without the held-out samples: their ids dropped and each span shortened to match (an
    emptied span dropped), so streaming's shuffle and partition see a smaller epoch of the same shape."""
    keep = ~_is_held(ids, held)
    if not len(units):
        return units, ids
    kept = np.add.reduceat(keep.astype(np.int64), np.cumsum(units) - units)
    return kept[kept > 0].astype(np.int64), ids[keep]


def leave_out(dataset, held: np.ndarray, num_ranks: int) -> None:
    """Make `dataset` (a data.streaming_base.StreamingBase) leave `held` out of every epoch, and its
    epoch (and per-rank length) that much shorter."""
    per_stream = np.diff(np.searchsorted(held, [*dataset.sample_offset_per_stream, dataset.num_samples]))
    dropped = 0
    for stream, samples, n in zip(dataset.streams, dataset.samples_per_stream, per_stream):
        repeat, rest = divmod(int(stream.choose), int(samples))
        if n and rest:  # data/streams.py refuses such weights first; this guards the arithmetic
            raise ValueError(
                "holdout: a stream read a fraction of its samples per epoch cannot hold samples out"
            )
        dropped += int(n) * repeat
    dataset.held_out = held
    dataset.epoch_size -= dropped
    dataset.length = math.ceil(dataset.epoch_size / num_ranks)
    log.info(
        "data.train.holdout: %d of %d samples kept out of training (%d samples an epoch)",
        len(held), dataset.num_samples, dataset.epoch_size,
    )  # fmt: skip


class HeldOut(torch.utils.data.Dataset):
    """The held-out samples of a training dataset that `leave_out` was applied to, read unaugmented
    (its `unaugmented`): the same pixels every evaluation."""

    def __init__(self, source):
        self.source = source
        self.ids = source.held_out

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index: int):
        return self.source.unaugmented(int(self.ids[index]))
