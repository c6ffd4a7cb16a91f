"""Streaming dataset of precomputed latents, as written by `python -m convert latents`.

Rows hold `latents_{R}` (the VAE posterior's mean and logvar at resolution R, unscaled, fp16) and
`text_embeds` (77, D) fp16. The model samples from the moments and applies the latent scale itself,
so training on these is the same computation as training on the images.
"""

import torch

from data.streaming_base import StreamingBase


def latents_column(resolution: int) -> str:
    return f"latents_{resolution}"


class LatentsDataset(StreamingBase):
    def __init__(self, *, resolution: int, **streaming_kwargs):
        super().__init__(**streaming_kwargs)
        self.column = latents_column(resolution)

    def __getitem__(self, index):
        sample = super().__getitem__(index)
        if self.column not in sample:
            have = sorted(k for k in sample if k.startswith("latents_"))
            raise KeyError(
                f"no {self.column} column in this dataset (it has {have}); convert at this resolution"
            )
        # One copy into writable float32 memory: from_numpy(...).float() kept fp32 columns in the
        # read-only sample buffer (a UserWarning in every worker, seen on the first GPU run).
        return {
            "latents": torch.tensor(sample[self.column], dtype=torch.float32),
            "text_embeds": torch.tensor(sample["text_embeds"], dtype=torch.float32),
        }
