"""Validation at K fixed timesteps (`model.eval_timesteps: K`), MLPerf's rule for its Flux benchmark.

MLPerf Training's text_to_image reference (github.com/mlcommons/training, text_to_image/README.md,
"Quality metric"; its torchtitan submodule at 9603aa83, branch mlperf-training-flux.1,
torchtitan/experiments/flux/train.py `eval_step`) evaluates each validation sample at one of 8
timesteps t = i / 8, i = 0..7 ("8 equidistant time steps [0, 7/8]", the SD3 paper's protocol), i
assigned once when the set is made (scripts/coco_to_webdataset.py: `np.arange(len(df)) % 8` after a
shuffle with seed 2023), and reports the mean over the 8 timesteps of each one's mean loss.

Here the sample's eval seed picks it: i = seed mod K. The seed is a hash of the sample's content
(LatentDiffusion.eval_seeds), which also seeds its noise, so a sample keeps its timestep and its noise
in any batch, order or number of devices. The K values are equally likely, not equally frequent (a
set of N samples gets about N / K +- sqrt(N / K) of each), so the metric is MLPerf's algorithm as
written, the mean over timesteps of each one's mean, which weights the timesteps equally whatever
their counts (and is the plain mean when they are equal, as in MLPerf's set).

Each objective puts the K levels on its own scale (`fixed_levels`): rectified flow's t = i / K,
unshifted, as the reference; DDPM's integer timesteps floor(i T / K) of its T training timesteps (0,
125, ..., 875 for T = 1000 and K = 8), the same fractions of its schedule.
"""

import torch
from torchmetrics import Metric

from models.engine.objectives import mse_per_sample


def check_eval_timesteps(value) -> int:
    """`value` if it is a whole number of timesteps, 2 or more; else a one-line error naming the key."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 2:
        raise ValueError(
            f"model.eval_timesteps must be a whole number of timesteps, 2 or more (MLPerf's Flux rule: 8), "
            f"or null, got {value!r}"
        )
    return value


def level_indices(seeds: list[int], k: int) -> torch.Tensor:
    """Each sample's fixed timestep, 0 .. k - 1, from its eval seed."""
    return torch.tensor([seed % k for seed in seeds], dtype=torch.long)


# A precomputed set's column of each sample's fixed timestep index i, t = i / STORED_LEVELS: MLPerf's
# COCO set stores one (convert/mlperf_flux.py); the dataset hands it over under this key.
STORED = "eval_timestep"
STORED_LEVELS = 8  # MLPerf's: the reference's eval_step takes t = timesteps / 8.0


def stored_or_seeded(batch: dict, seeds: list[int], k: int) -> torch.Tensor:
    """Each sample's fixed timestep index: the set's own (STORED) where it has one, which needs k =
    STORED_LEVELS, else from its eval seed."""
    if STORED not in batch:
        return level_indices(seeds, k)
    stored = torch.as_tensor(batch[STORED]).long().cpu().reshape(-1)
    if k != STORED_LEVELS or not bool(((stored >= 0) & (stored < k)).all()):
        raise ValueError(
            f"the validation set stores MLPerf's fixed timesteps (i in 0 .. {STORED_LEVELS - 1}, t = i / "
            f"{STORED_LEVELS}; here {sorted(set(stored.tolist()))[:8]}): set model.eval_timesteps="
            f"{STORED_LEVELS}, not {k}"
        )
    return stored


class FixedTimestepLoss(Metric):
    """The mean over the fixed levels of each level's mean per-sample MSE (prediction against target,
    unweighted), over the levels that received samples. `levels`: the objective's `fixed_levels(K)`;
    `update` takes the model's validation outputs (prediction, target, level)."""

    full_state_update = False
    higher_is_better = False
    is_differentiable = False

    def __init__(self, levels: torch.Tensor):
        super().__init__()
        self.levels = levels.clone()
        self.add_state("sums", default=torch.zeros(len(levels), dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("counts", default=torch.zeros(len(levels), dtype=torch.float64), dist_reduce_fx="sum")

    def update(self, prediction: torch.Tensor, target: torch.Tensor, level: torch.Tensor) -> None:
        matches = level.reshape(-1, 1) == self.levels.to(level.device).reshape(1, -1)
        if not bool(matches.any(dim=1).all()):
            raise ValueError("a validation sample's timestep is not one of the fixed levels")
        index = matches.int().argmax(dim=1).to(self.sums.device)
        losses = mse_per_sample(prediction, target).to(self.sums)
        self.sums.index_add_(0, index, losses)
        self.counts.index_add_(0, index, torch.ones_like(losses))

    def per_level(self) -> torch.Tensor:
        """Each level's mean loss (NaN for a level without samples)."""
        return self.sums / self.counts

    def compute(self) -> torch.Tensor:
        seen = self.counts > 0
        return (self.sums[seen] / self.counts[seen]).mean()
