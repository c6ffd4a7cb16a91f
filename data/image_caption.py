"""Streaming image-caption dataset: MDS rows with `image` and `caption` -> training batches.

Each sample becomes `image` (3, R, R) uint8 (resize shorter side, center crop, optional horizontal
flip; the model makes [-1, 1] floats of it on the device, models/pixels.py; with aspect-ratio buckets
(3, H, W) floats in [-1, 1], its bucket's size: data/buckets.py) and
`input_ids` (77,) CLIP tokens. Caption dropout is the model's job (`model.caption_drop_prob`), so it
works the same on precomputed latents. The DataLoader and the config keys: data/loader.py.
"""

import functools
import io
import random

import torch
from PIL import Image
from torchvision.transforms import functional as F

from data.streaming_base import StreamingBase
from data.transforms import SquareTransform, square_pixels
from models.tokenizer import CaptionEncoder

TOKEN_CACHE_SIZE = 4096  # 4096 x 77 int64 = 2.5 MB per dataset


@functools.lru_cache
def image_transform(resolution: int, uint8: bool = False) -> SquareTransform:
    """Encoded bytes or an opened image -> (3, R, R) in [-1, 1] (`uint8`: 0-255): resize the shorter
    side, center crop, as torchvision's Resize + CenterCrop within one 8-bit level, faster; large
    JPEG bytes decode at a reduced DCT scale, a few levels off (data/transforms.py). Training and
    `convert latents` both use it, so precomputed latents see the same pixels."""
    return SquareTransform(resolution, uint8)


def cover_crop(image: bytes | Image.Image, height: int, width: int) -> torch.Tensor:
    """Encoded bytes or an opened image -> (3, height, width) in [-1, 1]: resize to cover, then center
    crop. For a square size this is exactly `image_transform(height)` (shorter side resized, center
    crop)."""
    if height == width:
        return image_transform(height)(image)
    if isinstance(image, bytes):
        image = Image.open(io.BytesIO(image))
    image = image.convert("RGB")
    scale = max(height / image.height, width / image.width)
    resized = F.resize(
        image, [max(height, round(image.height * scale)), max(width, round(image.width * scale))]
    )
    pixels = F.to_tensor(F.center_crop(resized, [height, width]))
    return F.normalize(pixels, [0.5], [0.5])


class ImageCaptionDataset(StreamingBase):
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
        # The ids of `tokenize(self.tokenizer, [caption])[0]`, 3-5x faster (models/tokenizer.py).
        encoder = self.__dict__.get("_encoder")
        if encoder is None or encoder.tokenizer is not self.tokenizer:
            encoder = self._encoder = CaptionEncoder(self.tokenizer)
        return encoder(caption)

    def _flips(self, index: int) -> bool:
        return _flip_decision(index, max(self.next_epoch - 1, 0))

    def __getitem__(self, index):
        sample = super().__getitem__(index)
        image = sample[self.image_key]  # encoded bytes, or an image for MDS's jpeg/png/pil columns
        flip = self.hflip and self._flips(index)
        if self.sizes is None:  # uint8: the model makes [-1, 1] floats of it on the device
            pixels = square_pixels(image, self.transform.resolution, flip)
        else:  # this sample's stream is one bucket; floats
            shard, _ = self.spanner[index]
            pixels = cover_crop(image, *self.sizes[self.stream_per_shard[shard]])
            if flip:
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
