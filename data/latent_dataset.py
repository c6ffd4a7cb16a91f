"""Streaming dataset of precomputed latents, as written by `python -m convert latents`.

Rows hold `latents_{R}` (the VAE posterior's mean and logvar at resolution R, unscaled, fp16) and
`text_embeds` (77, D) fp16. The model samples from the moments and applies the latent scale itself,
so training on these is the same computation as training on the images.

An SDXL preset's rows also hold what its UNet reads besides (models/sdxl.py): `pooled_text_embeds`
(1280,) fp16, the second text encoder's projected pooled output, and the micro-conditioning sizes,
`original_size` (height, width) and per resolution `crop_top_left_{R}` (top, left) int64, which a
sample carries as `crop_top_left`. An mmdit preset's rows (models/mmdit.py) hold `text_embeds`
(77, 768 + 1280 for sd3-medium: both CLIPs' context, unpadded), `pooled_text_embeds` (2048,) and,
when converted with a T5, `text_embeds_3` (t5_tokens, 4096), all fp16. A set without a column (an SD
preset's) gives samples without its key.
"""

import torch

from data.streaming_base import StreamingBase


def latents_column(resolution: int) -> str:
    return f"latents_{resolution}"


def crop_column(resolution: int) -> str:
    return f"crop_top_left_{resolution}"


class LatentsDataset(StreamingBase):
    def __init__(self, *, resolution: int, **streaming_kwargs):
        super().__init__(**streaming_kwargs)
        self.column = latents_column(resolution)
        self.crop_column = crop_column(resolution)

    def __getitem__(self, index):
        sample = super().__getitem__(index)
        if self.column not in sample:
            have = sorted(k for k in sample if k.startswith("latents_"))
            raise KeyError(
                f"no {self.column} column in this dataset (it has {have}); convert at this resolution"
            )
        # One copy into writable float32 memory: from_numpy(...).float() kept fp32 columns in the
        # read-only sample buffer, and torch warns about that in every worker.
        out = {
            "latents": torch.tensor(sample[self.column], dtype=torch.float32),
            "text_embeds": torch.tensor(sample["text_embeds"], dtype=torch.float32),
        }
        for name in ("pooled_text_embeds", "text_embeds_3"):
            if name in sample:
                out[name] = torch.tensor(sample[name], dtype=torch.float32)
        if "original_size" in sample:
            out["original_size"] = torch.tensor(sample["original_size"], dtype=torch.int64)
        if self.crop_column in sample:
            out["crop_top_left"] = torch.tensor(sample[self.crop_column], dtype=torch.int64)
        return out
