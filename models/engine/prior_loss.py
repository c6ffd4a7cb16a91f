"""DreamBooth's prior-preservation loss, for every family (LatentDiffusion.loss applies it).

diffusers' examples/dreambooth/train_dreambooth.py puts n instance examples and n class ("prior")
examples in one batch and splits the loss:
    instance_loss = mse(pred[:n], target[:n]);  prior_loss = mse(pred[n:], target[n:])
    loss = instance_loss + prior_loss_weight * prior_loss
Here a batch carries a per-sample flag (`PRIOR`, 1 for a class image: recipes/dreambooth.py writes
it into both sets), and every global batch holds class images in a fixed share (streaming's
stratified batching: half). Each sample's loss is weighted by 1 / its group's share (times
prior_loss_weight for a class image) and the batch is averaged: with half and half that is exactly
diffusers' sum of two means. Being a plain mean of per-sample terms, it stays exact however the global
batch is split over devices and microbatches (whose means Composer and DDP average), even when a
split holds only one kind of image, as stratified batching's contiguous splits do. Each per-sample
loss keeps the objective's own weight (min-SNR, a flow weighting), as the objective's mean would.
"""

import torch

PRIOR = "prior"  # the batch column: 1 for a class (prior-preservation) image, 0 for an instance image


def prior_preservation_loss(
    per_sample: torch.Tensor, prior: torch.Tensor, weight: float, prior_share: float = 0.5
) -> torch.Tensor:
    """mean over the batch of `per_sample` (B,) losses, a class image's times weight / prior_share,
    an instance image's times 1 / (1 - prior_share); prior_share 0 (no class images): the plain mean."""
    if not 0.0 <= prior_share < 1.0:
        raise ValueError(f"prior_share must be in [0, 1), got {prior_share}")
    is_prior = prior.to(per_sample.device).bool().view(-1)
    instance_factor = 1.0 / (1.0 - prior_share)
    prior_factor = weight / prior_share if prior_share > 0 else 0.0  # no class images expected
    factors = torch.where(is_prior, prior_factor, instance_factor).to(per_sample.dtype)
    return (per_sample * factors).mean()
