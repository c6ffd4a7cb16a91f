"""Image -> training pixels, shared by the data loader (data/image_caption.py) and `convert latents`
(through `image_transform` and `cover_crop`), so precomputed latents see the same pixels as training.

`square_pixels(image, R)` is torchvision's Resize(R) (bilinear, antialiased: the shorter side to R)
then CenterCrop(R), as uint8 and in a third to a half of the time:
- JPEG bytes (what `sd-convert` stores) have their size read by `data.headers.sniff` (PIL's
  header parse costs ~0.13 ms a sample) and decode with torchvision's `decode_jpeg` straight into a
  tensor: the same pixels as PIL (both libjpeg-turbo; tested bit-equal), 1.3-1.8x faster than PIL's
  decode plus its copy into an array.
- A JPEG whose shorter side is at least 2R decodes at 1/2, 1/4 or 1/8 scale in libjpeg's DCT (PIL's
  draft mode), the largest reduction that keeps the shorter side >= R, and is resized from there
  with the full image's geometry (every output pixel centred where a full decode puts it): 1.6x less
  decode time at 1024x768 -> 256 px. The price is the filter: the DCT's box-like reduction instead of
  Resize's triangle. Measured against a full decode on 1/f ("natural") noise JPEGs, 1,001-2,048 px:
  1.4-2.9 8-bit levels on average, 5-10 at the 99th percentile (5.5 on average before the geometry
  correction). `draft=False` gives torchvision's pixels.
- The resize is torch's uint8 antialiased bilinear kernel on channels-last memory, 3x faster than
  PIL's (AVX2; checked to give the same values without it, ATEN_CPU_CAPABILITY=default). It follows
  PIL's fixed-point arithmetic: against Resize + CenterCrop, at most one 8-bit level (0.0078 in
  [-1, 1] units) on a few pixels (tests/test_data.py).
Training and `convert latents` both pass the stored bytes, so precomputed latents see the same pixels.
`square_crop` is `square_pixels` that also says where it cropped (SDXL's micro-conditioning:
data/image_caption.py).

The data loader hands over uint8 (a quarter of the bytes to collate, pass between processes and copy
to the device); `models.engine.pixels.to_float` makes [-1, 1] floats of them on the device with the
arithmetic of torchvision's ToTensor + Normalize(0.5, 0.5), so uint8 and float pixels give the model
bit-identical inputs. Timings: bench/loader.py, docs/benchmarks.md.
"""

import io
from typing import NamedTuple

import numpy as np
import torch
from PIL import Image
from torch.nn import functional as F
from torchvision.io import ImageReadMode, decode_jpeg

from data.headers import sniff
from models.engine.pixels import to_float

JPEG_MODES = ("RGB", "L")  # what decode_jpeg and PIL turn into the same RGB; CMYK and others go through PIL
DRAFT_SCALES = (8, 4, 2)  # libjpeg's DCT scaling: decode at 1/8, 1/4 or 1/2 of the size


def resized_size(width: int, height: int, resolution: int) -> tuple[int, int]:
    """(width, height) after torchvision's Resize(resolution): the shorter side to `resolution`, the
    longer truncated to keep the aspect ratio."""
    if width <= height:
        return resolution, int(resolution * height / width)
    return int(resolution * width / height), resolution


def rgb_tensor(
    image: bytes | Image.Image, resolution: int, draft: bool = True
) -> tuple[torch.Tensor, tuple, int]:
    """Encoded bytes or an opened image -> (uint8 (3, H, W) RGB, channels-last in memory as the resize
    kernel likes it; the image's full (width, height); the factor it was decoded smaller by). JPEG
    bytes: `decode_jpeg`, or at a reduced DCT scale when `draft` and the shorter side stays >=
    `resolution`."""
    data = image if isinstance(image, (bytes, bytearray, memoryview)) else None
    reduction = 1
    if data is not None:
        # A few microseconds where PIL's header parse takes ~0.13 ms, 4% of a 512x384 sample;
        # anything the sniffer does not know (other codings, CMYK, 12-bit) goes to PIL as before.
        header = sniff(bytes(data) if isinstance(data, memoryview) else data)
        if header is not None and header.format == "JPEG" and header.mode in JPEG_MODES:
            size = header.width, header.height
            if draft:
                reduction = next((r for r in DRAFT_SCALES if min(size) // r >= resolution), 1)
            if reduction == 1:
                encoded = torch.frombuffer(bytearray(data), dtype=torch.uint8)
                try:
                    pixels = decode_jpeg(encoded, ImageReadMode.RGB)
                except RuntimeError as error:  # the OSError PIL raises, so callers catch one kind
                    raise OSError(f"corrupt JPEG: {error}") from error
                return pixels.permute(1, 2, 0).contiguous().permute(2, 0, 1), size, 1
        image = Image.open(io.BytesIO(data))  # reads the header only
    size = image.size
    if reduction > 1:
        image.draft("RGB", (image.width // reduction, image.height // reduction))
    rgb = image if image.mode == "RGB" else image.convert("RGB")
    return torch.from_numpy(np.array(rgb)).permute(2, 0, 1), size, reduction


class Crop(NamedTuple):
    """A training crop and where it came from: what SDXL's micro-conditioning needs."""

    pixels: torch.Tensor
    size: tuple[int, int]  # (height, width) of the whole image as stored, before the resize
    top_left: tuple[int, int]  # (top, left) of the crop in the resized image; mirrored with the pixels


def crop_top_left(top: int, left: int, resized_width: int, crop_width: int, flip: bool) -> tuple[int, int]:
    """(top, left) of a crop; with `flip`, of the mirrored crop in the mirrored image: its left edge
    is the unmirrored crop's right edge, counted from the other side. The model then sees offsets
    that describe the pixels it gets, whichever way they face."""
    return top, (resized_width - left - crop_width) if flip else left


def square_pixels(
    image: bytes | Image.Image, resolution: int, flip: bool = False, draft: bool = True
) -> torch.Tensor:
    """Encoded bytes or an opened image (any mode) -> uint8 (3, R, R): Resize(R) + CenterCrop(R),
    mirrored left-right when `flip`."""
    return square_crop(image, resolution, flip, draft).pixels


def square_crop(image: bytes | Image.Image, resolution: int, flip: bool = False, draft: bool = True) -> Crop:
    """`square_pixels`, with the image's size and the crop's offsets in the resized image."""
    pixels, (width, height), reduction = rgb_tensor(image, resolution, draft)
    new_width, new_height = resized_size(width, height, resolution)
    # CenterCrop's offsets in the resized image, rounded as torchvision rounds them.
    left, top = int(round((new_width - resolution) / 2.0)), int(round((new_height - resolution) / 2.0))
    resize = dict(mode="bilinear", align_corners=False, antialias=True)
    if reduction > 1:
        # Decoded pixel k covers full-size pixels [r k, r k + r): the image is (width / r) pixels wide
        # (ceil'ed when r does not divide it). Resizing with the scale of that fractional width puts
        # every output pixel where a full decode's resize puts it.
        scale = (new_height * reduction / height, new_width * reduction / width)
        pixels = F.interpolate(pixels[None], scale_factor=scale, recompute_scale_factor=False, **resize)[0]
    elif (new_width, new_height) != (width, height):  # else Resize leaves it as it is: a plain crop
        pixels = F.interpolate(pixels[None], (new_height, new_width), **resize)[0]
    pixels = pixels[:, top : top + resolution, left : left + resolution]
    # Contiguous (CHW) as the models expect: a channels-last batch takes other convolution kernels,
    # whose results depend on the batch size (`convert latents` on 1 and 2 workers then differ).
    pixels = (pixels.flip(-1) if flip else pixels).contiguous()
    return Crop(pixels, (height, width), crop_top_left(top, left, new_width, resolution, flip))


class SquareTransform:
    """`image_transform(R)`: encoded bytes or an opened image -> float (3, R, R) in [-1, 1]
    (`uint8=True`: uint8)."""

    def __init__(self, resolution: int, uint8: bool = False):
        self.resolution, self.uint8 = resolution, uint8

    def __call__(self, image: bytes | Image.Image) -> torch.Tensor:
        pixels = square_pixels(image, self.resolution)
        return pixels if self.uint8 else to_float(pixels)

    def __repr__(self) -> str:
        return f"SquareTransform(resolution={self.resolution}, uint8={self.uint8})"
