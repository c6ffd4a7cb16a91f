"""Streaming image-caption dataset: MDS rows with `image` and `caption` -> training batches.

Each sample becomes `image` (3, R, R) uint8 (resize shorter side, center crop, optional horizontal
flip; the model makes [-1, 1] floats of it on the device, models/engine/pixels.py; with aspect-ratio buckets
(3, H, W) floats in [-1, 1], its bucket's size: data/buckets.py) and
`input_ids` (77,) CLIP tokens. Caption dropout is the model's job (`model.caption_drop_prob`), so it
works the same on precomputed latents. The DataLoader and the config keys: data/loader.py.

SDXL (models/families/sdxl/model.py) reads more: `input_ids_2` (77,) from its second tokenizer, and with
`micro_conditioning` the two sizes it is conditioned on besides the target size, so that it learns
what a small upscaled image and a cropped one look like instead of drawing them unasked (SDXL paper,
section 2.2): `original_size` (height, width) of the image before the converter resized it (its
`original_height`/`original_width` columns, else the stored image's size) and `crop_top_left`
(top, left) of the training crop in the resized image, as LongTensors (2,). Without the flags a
sample holds `image` and `input_ids` only (what SD1/SD2 read).

A model that reads T5 (an mmdit model with `text_encoder_3`, a flux model) reads `input_ids_3` too:
T5's ids of the caption, `t5_tokens` long (`t5_tokenizer`: SD3's tokenizer_3, Flux's tokenizer_2),
as the pipelines tokenize with max_sequence_length=t5_tokens. A model whose text encoder is an LLM
(zimage) gives its own `caption_ids` (caption -> columns: the chat prompt's ids) instead of CLIP's.
"""

import functools
import io
import random

import torch
from PIL import Image
from torchvision.transforms import functional as F

from data.streaming_base import StreamingBase
from data.transforms import Crop, SquareTransform, crop_top_left, square_crop
from models.engine.conditioners import T5_IDS
from models.engine.draw_keys import SAMPLE_INDEX
from models.engine.eval_timesteps import STORED as EVAL_TIMESTEP
from models.engine.pixels import to_float
from models.engine.prior_loss import PRIOR
from models.engine.tokenizer import tokenize, tokenize_t5

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
    return bucket_crop(image, height, width).pixels


def bucket_crop(image: bytes | Image.Image, height: int, width: int, flip: bool = False) -> Crop:
    """`cover_crop`, mirrored when `flip`, with the image's size and the crop's offsets."""
    if height == width:
        crop = square_crop(image, height, flip)
        return crop._replace(pixels=to_float(crop.pixels))
    if isinstance(image, bytes):
        image = Image.open(io.BytesIO(image))
    image = image.convert("RGB")
    scale = max(height / image.height, width / image.width)
    new_height = max(height, round(image.height * scale))
    new_width = max(width, round(image.width * scale))
    resized = F.resize(image, [new_height, new_width])
    pixels = F.normalize(F.to_tensor(F.center_crop(resized, [height, width])), [0.5], [0.5])
    # F.center_crop's offsets, rounded as it rounds them.
    top, left = int(round((new_height - height) / 2.0)), int(round((new_width - width) / 2.0))
    return Crop(
        pixels.flip(-1) if flip else pixels,
        (image.height, image.width),
        crop_top_left(top, left, new_width, width, flip),
    )


def original_size(row: dict, stored: tuple[int, int]) -> tuple[int, int]:
    """(height, width) of a row's image before the converter resized it: its `original_height` and
    `original_width` (sd-convert writes them), else `stored`, the stored image's size (a set
    converted before those columns, or by another tool: it was not resized as far as we know)."""
    height, width = row.get("original_height"), row.get("original_width")
    if height is None or width is None or height <= 0 or width <= 0:
        return stored
    return int(height), int(width)


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
        tokenizer_2=None,
        micro_conditioning: bool = False,
        t5_tokenizer=None,
        t5_tokens: int | None = None,
        caption_ids=None,
        **streaming_kwargs,
    ):
        super().__init__(**streaming_kwargs)
        # Per stream (height, width) for aspect-ratio buckets (data/buckets.py); None: square crops.
        self.sizes = sizes
        self.tokenizer, self.tokenizer_2 = tokenizer, tokenizer_2
        self.micro_conditioning = micro_conditioning
        if t5_tokenizer is not None and not t5_tokens:
            raise ValueError("t5_tokenizer needs t5_tokens, the length of its ids")
        self.t5_tokenizer, self.t5_tokens = t5_tokenizer, t5_tokens
        # caption -> its id columns, in place of `tokenizer`'s 77 CLIP ids (an LLM conditioner's chat
        # prompt: models/engine/llm_conditioner.py CaptionIds)
        self.caption_ids = caption_ids
        self.image_key, self.caption_key = image_key, caption_key
        self.transform = image_transform(resolution)
        self.hflip = hflip
        # The slow (pure Python) CLIP tokenizer costs ~0.6 ms a caption; repeated captions (common
        # in small or synthetic sets) are tokenized once.
        self._token_ids = functools.lru_cache(maxsize=TOKEN_CACHE_SIZE)(self._tokenize)
        self._token_ids_2 = functools.lru_cache(maxsize=TOKEN_CACHE_SIZE)(self._tokenize_2)
        self._token_ids_3 = functools.lru_cache(maxsize=TOKEN_CACHE_SIZE)(self._tokenize_3)

    def _tokenize(self, caption: str):
        if self.caption_ids is not None:
            return self.caption_ids(caption)
        return {"input_ids": tokenize(self.tokenizer, [caption])[0]}

    def _tokenize_2(self, caption: str):
        return tokenize(self.tokenizer_2, [caption])[0]

    def _tokenize_3(self, caption: str):
        return tokenize_t5(self.t5_tokenizer, [caption], self.t5_tokens)[0]

    def _flips(self, index: int) -> bool:
        return _flip_decision(index, max(self.next_epoch - 1, 0))

    def __getitem__(self, index):
        return self._sample(index, self.hflip and self._flips(index))

    def unaugmented(self, index: int) -> dict:
        return self._sample(index, False)

    def _sample(self, index, flip: bool) -> dict:
        sample = super().__getitem__(index)
        image = sample[self.image_key]  # encoded bytes, or an image for MDS's jpeg/png/pil columns
        if self.sizes is None:  # uint8: the model makes [-1, 1] floats of it on the device
            crop = square_crop(image, self.transform.resolution, flip)
        else:  # this sample's stream is one bucket; floats
            shard, _ = self.spanner[index]
            crop = bucket_crop(image, *self.sizes[self.stream_per_shard[shard]], flip)
        caption = sample[self.caption_key]
        out = {"image": crop.pixels, **{k: v.clone() for k, v in self._token_ids(caption).items()}}
        if self.tokenizer_2 is not None:
            out["input_ids_2"] = self._token_ids_2(caption).clone()
        if self.t5_tokenizer is not None:
            out[T5_IDS] = self._token_ids_3(caption).clone()
        if self.micro_conditioning:
            out["original_size"] = torch.tensor(original_size(sample, crop.size))
            out["crop_top_left"] = torch.tensor(crop.top_left)
        if EVAL_TIMESTEP in sample:  # a set with its own fixed validation timesteps (MLPerf's COCO)
            out[EVAL_TIMESTEP] = int(sample[EVAL_TIMESTEP])
        if PRIOR in sample:  # DreamBooth's class-image flag (recipes/dreambooth.py)
            out[PRIOR] = int(sample[PRIOR])
        out[SAMPLE_INDEX] = int(index)  # training draws keyed per sample (models/engine/draw_keys.py)
        return out


def _flip_decision(index: int, epoch: int) -> bool:
    # A pure function of (sample, epoch) instead of the global RNG: the same flips whatever the
    # number of dataloader workers, and after a resume, which restores the RNG but cannot replay
    # the draws a fresh dataloader iterator makes.
    return random.Random(int(index) * 1_000_003 + int(epoch)).random() < 0.5
