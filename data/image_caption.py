"""Streaming image-caption dataset: MDS rows with `image` and `caption` -> training batches.

Each sample becomes `image` (3, R, R) in [-1, 1] (resize shorter side, center crop, optional
horizontal flip) and `input_ids` (77,) CLIP tokens. Caption dropout is the model's job
(`model.caption_drop_prob`), so it works the same on precomputed latents.
"""

import functools
import io
import random
from dataclasses import dataclass

import torch
from PIL import Image
from streaming import StreamingDataset
from torch.utils.data import DataLoader
from torchvision import transforms

from data.latents import LatentsDataset
from models.tokenizer import tokenize


@dataclass
class ImageCaptionDataConfig:
    """`data.train` / `data.eval` in the run YAML."""

    local: str | None = None  # local MDS folder, or the cache folder for `remote`
    remote: str | None = None  # e.g. s3://bucket/prefix; None reads `local` directly
    resolution: int = 256
    hflip: bool = True
    shuffle: bool = True
    num_workers: int = 0
    num_canonical_nodes: int | None = None  # fix it so 1 and N nodes see the same sample order
    drop_last: bool = True
    image_key: str = "image"
    caption_key: str = "caption"
    prepare: str | None = None  # a name in recipes.prepare.PREPARERS: build `local` if missing
    latents: bool = False  # read precomputed `latents_{resolution}` + `text_embeds` (convert latents)


@dataclass
class EvalDataConfig(ImageCaptionDataConfig):
    """`data.eval`: the same keys, but every sample once, in order, unaugmented."""

    hflip: bool = False
    shuffle: bool = False
    drop_last: bool = False


TOKEN_CACHE_SIZE = 4096  # 4096 x 77 int64 = 2.5 MB per dataset


@functools.lru_cache
def image_transform(resolution: int) -> transforms.Compose:
    """PIL RGB image -> (3, R, R) in [-1, 1]: resize the shorter side, center crop. Training and
    `convert latents` both use it, so precomputed latents see the same pixels."""
    steps = [transforms.Resize(resolution), transforms.CenterCrop(resolution)]
    return transforms.Compose(steps + [transforms.ToTensor(), transforms.Normalize([0.5], [0.5])])


class ImageCaptionDataset(StreamingDataset):
    def __init__(
        self,
        *,
        tokenizer,
        resolution: int,
        hflip: bool = False,
        image_key: str = "image",
        caption_key: str = "caption",
        **streaming_kwargs,
    ):
        super().__init__(**streaming_kwargs)
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
        pixels = self.transform(image.convert("RGB"))
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


def build_image_caption_dataloader(cfg: ImageCaptionDataConfig, tokenizer, batch_size: int) -> DataLoader:
    """A DataLoader over one MDS set (recipes.prepare.ensure_dataset checks it); `batch_size` is per
    device."""
    streaming = dict(
        local=cfg.local,
        remote=cfg.remote,
        shuffle=cfg.shuffle,
        batch_size=batch_size,
        num_canonical_nodes=cfg.num_canonical_nodes,
    )
    if cfg.latents:
        dataset = LatentsDataset(resolution=cfg.resolution, **streaming)
    else:
        dataset = ImageCaptionDataset(
            tokenizer=tokenizer,
            resolution=cfg.resolution,
            hflip=cfg.hflip,
            image_key=cfg.image_key,
            caption_key=cfg.caption_key,
            **streaming,
        )
    return DataLoader(
        dataset,
        batch_size=batch_size,
        num_workers=cfg.num_workers,
        drop_last=cfg.drop_last,
        persistent_workers=cfg.num_workers > 0,
        # Page-locked batches: the host-to-GPU copy can run asynchronously (Composer copies with
        # non_blocking=True); nothing to gain without a GPU.
        pin_memory=torch.cuda.is_available(),
    )
