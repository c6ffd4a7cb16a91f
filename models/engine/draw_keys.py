"""Training draws seeded per sample (`model.train_draws: sample`): each sample's latent sample, noise,
timestep and caption-dropout decision are a function of the run's seed, the batch index and the
sample's index in the dataset, never of the process that trains it.

By default (`rank`) training draws from the global RNG, which Composer seeds with seed + rank: the same
global batch on 2 processes then gets other noise than on 1, so a run's losses depend on its GPU count
and a restart on fewer GPUs (recipes/parallelism.py's elastic resume) continues with other draws than
the uninterrupted run would have made. Keyed per sample, a batch's draws are the same on any number of
processes, in any microbatching and in any order within the batch: the losses of a 1-process and a
sharded 2-process run agree to float rounding (tests/test_fsdp2_train.py), and an elastic restart
continues the same run. Validation is already seeded per sample (models/engine/latent_diffusion.py
`eval_seeds`), from the sample's content; training cannot hash its content every step (3 ms an
image), so it keys by the sample's index, which data/loader.py hands over as a list of ints on the
host (a tensor would be moved to the GPU and read back: a sync each step).

The draws come from one CPU generator per sample (the validation draws' code, models/engine/objectives.py),
so a CPU and a GPU run draw the same numbers; the cost is the CPU's: about 10 us a sample and the
normal draws (2 per latent element), a few ms per step for 32 SD images at 256 px, on the host while
the GPU works. Measure it on a GPU before making it every recipe's default (issue 41).
"""

import hashlib
import struct

TRAIN_DRAWS = ("rank", "sample")  # model.train_draws: the global RNG per rank (default), or per sample
SAMPLE_INDEX = "sample_index"  # the batch's column: each sample's index in its dataset (data/loader.py)


def check_train_draws(value: str) -> str:
    if value not in TRAIN_DRAWS:
        raise ValueError(f"model.train_draws={value!r}; choose one of {list(TRAIN_DRAWS)}")
    return value


def sample_indices(batch) -> list[int]:
    """The batch's sample indices as ints (a list from data/loader.py's collate, or a tensor)."""
    if SAMPLE_INDEX not in batch:
        raise ValueError(
            f"model.train_draws=sample needs each sample's index in the batch ({SAMPLE_INDEX!r}, which "
            "data/loader.py's datasets hand over); this batch has only " + ", ".join(sorted(batch))
        )
    indices = batch[SAMPLE_INDEX]
    return [int(i) for i in (indices.tolist() if hasattr(indices, "tolist") else indices)]


def draw_seeds(seed: int, batch_index: int, indices: list[int]) -> tuple[list[int], list[float]]:
    """Per sample: a 63-bit seed for the objective's draws, and a uniform number in [0, 1) for caption
    dropout, from blake2b of (seed, batch index, sample index). The batch index keeps a sample's draws
    apart across epochs and between its copies in an upsampled epoch."""
    seeds, uniforms = [], []
    for index in indices:
        digest = hashlib.blake2b(struct.pack("<qqq", seed, batch_index, index), digest_size=16).digest()
        seeds.append(int.from_bytes(digest[:8], "little") >> 1)
        uniforms.append((int.from_bytes(digest[8:], "little") >> 11) * 2.0**-53)  # 53 random bits
    return seeds, uniforms
