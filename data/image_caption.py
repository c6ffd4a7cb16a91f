"""Streaming image-caption dataset: MDS rows with `image` and `caption` -> training batches.

Each sample becomes `image` (3, R, R) in [-1, 1] (resize shorter side, center crop, optional
horizontal flip; with aspect-ratio buckets (3, H, W), its bucket's size: data/buckets.py) and
`input_ids` (77,) CLIP tokens. Caption dropout is the model's job (`model.caption_drop_prob`), so it
works the same on precomputed latents. The DataLoader and the config keys: data/loader.py.
"""

import functools
import io
import random

import torch
from PIL import Image
from streaming import StreamingDataset
from torchvision import transforms
from torchvision.transforms import functional as F

from models.tokenizer import tokenize

TOKEN_CACHE_SIZE = 4096  # 4096 x 77 int64 = 2.5 MB per dataset


@functools.lru_cache
def image_transform(resolution: int) -> transforms.Compose:
    """PIL RGB image -> (3, R, R) in [-1, 1]: resize the shorter side, center crop. Training and
    `convert latents` both use it, so precomputed latents see the same pixels."""
    steps = [transforms.Resize(resolution), transforms.CenterCrop(resolution)]
    return transforms.Compose(steps + [transforms.ToTensor(), transforms.Normalize([0.5], [0.5])])


def cover_crop(image: Image.Image, height: int, width: int) -> torch.Tensor:
    """PIL RGB -> (3, height, width) in [-1, 1]: resize to cover, then center crop. For a square size
    this is exactly `image_transform(height)` (shorter side resized, center crop)."""
    if height == width:
        return image_transform(height)(image)
    scale = max(height / image.height, width / image.width)
    resized = F.resize(
        image, [max(height, round(image.height * scale)), max(width, round(image.width * scale))]
    )
    pixels = F.to_tensor(F.center_crop(resized, [height, width]))
    return F.normalize(pixels, [0.5], [0.5])


class ImageCaptionDataset(StreamingDataset):
    def __init__(
        self,
        *,
        tokenizer,
        resolution: int,
        hflip: bool = False,
        image_key: str = "image",
        caption_key: str = "caption",
        sizes: list[tuple[int, int]] | None = None,
        **streaming_kwargs,
    ):
        super().__init__(**streaming_kwargs)
        # Per stream (height, width) for aspect-ratio buckets (data/buckets.py); None: square crops.
        self.sizes = sizes
        self.tokenizer = tokenizer
        self.image_key, self.caption_key = image_key, caption_key
        self.transform = image_transform(resolution)
        self.hflip = hflip
        # The slow (pure Python) CLIP tokenizer costs ~0.6 ms a caption; repeated captions (common
        # in small or synthetic sets) are tokenized once.
        self._token_ids = functools.lru_cache(maxsize=TOKEN_CACHE_SIZE)(self._tokenize)

    def _tokenize(self, caption: str):
        return tokenize(self.tokenizer, [caption])[0]

    def _flips(self, index: int) -> bool:
        return _flip_decision(index, max(self.next_epoch - 1, 0))

    def __getitem__(self, index):
        sample = super().__getitem__(index)
        image = sample[self.image_key]
        if isinstance(image, bytes):
            image = Image.open(io.BytesIO(image))
        if self.sizes is None:
            pixels = self.transform(image.convert("RGB"))
        else:  # this sample's stream is one bucket
            shard, _ = self.spanner[index]
            pixels = cover_crop(image.convert("RGB"), *self.sizes[self.stream_per_shard[shard]])
        if self.hflip and self._flips(index):
            pixels = pixels.flip(-1)
        return {
            "image": pixels,
            "input_ids": self._token_ids(sample[self.caption_key]).clone(),
        }


def _flip_decision(index: int, epoch: int) -> bool:
    # A pure function of (sample, epoch) instead of the global RNG: the same flips whatever the
    # number of dataloader workers, and after a resume, which restores the RNG but cannot replay
    # the draws a fresh dataloader iterator makes.
    return random.Random(int(index) * 1_000_003 + int(epoch)).random() < 0.5
