"""Check, repair and optionally resize one encoded image; hostile files become a skip reason.

Two paths:
- fast: a whole 8-bit RGB/grey/palette JPEG or PNG without EXIF that needs no resize keeps its original
  bytes after a header check (data.headers), never decoded or re-encoded;
- careful: everything else is opened and fully decoded with PIL, which catches truncated and corrupt
  data, then repaired (CMYK, 16-bit, transparency, EXIF orientation -> plain RGB), resized and
  re-encoded only if something changed.
`--verify decode` sends every image down the careful path.

Each prepared image also carries its original size: (width, height) before the resize, upright (after
EXIF orientation, as training sees it). SDXL conditions on it (micro-conditioning: data/image_caption.py),
so that a model learns what an upscaled small image looks like instead of learning to draw blur;
a resize here would otherwise hide it. With --center-crop it is the centred square's size before the
resize: the stored pixels show that square, and the training crop's offsets are measured in them.
"""

import io
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
from PIL import Image, ImageOps

from data.headers import Header, sniff

ORIENTATION_TAG = 0x0112
PASS_MODES = {"RGB", "L", "P", "1"}  # what a reader's convert("RGB") turns into the right pixels
ALPHA_MODES = {"RGBA", "LA", "PA", "RGBa", "La"}
LOSSLESS_FORMATS = {"PNG", "GIF", "BMP", "TIFF", "PPM", "TGA", "QOI", "ICO"}
ENCODE_FORMATS = ("auto", "jpeg", "png", "webp")
# Images whose shorter side is below this many pixels are skipped by default: a 1-pixel image would
# train as a 256 px blur (the loader resizes every image up to the training size). 16 keeps the
# smallest images this repo makes (synthetic shapes: 32 px; the tests' fixtures: 20-48 px).
MIN_SIDE = 16


class SkipSample(Exception):
    """Raised for an image that cannot be used; `reason` is what the report counts."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


@dataclass(frozen=True)
class ImageOptions:
    resize_max: int | None = None  # downscale so the shorter side is at most this (never upscale)
    center_crop: bool = False  # then crop the centred square
    encode_format: str = "auto"  # for re-encoded images; auto: PNG for lossless sources, else JPEG
    encode_quality: int = 95
    max_pixels: int = 64_000_000  # decompression-bomb limit, checked from the header before decoding
    min_side: int = MIN_SIDE  # skip (filtered_min_side) when the shorter side is below it; 0 keeps all
    verify: str = "header"  # "decode": fully decode every image, even ones passed through


class PreparedImage(NamedTuple):
    data: bytes  # to store
    width: int  # of `data`
    height: int
    repairs: tuple[str, ...]
    original_width: int  # before the resize (and after EXIF orientation)
    original_height: int


def prepare_image(data: bytes, opts: ImageOptions) -> tuple[bytes, int, int, tuple[str, ...]]:
    """(bytes to store, width, height, repairs made) for one encoded image, or raise SkipSample."""
    return prepare_image_sized(data, opts)[:4]


def prepare_image_sized(data: bytes, opts: ImageOptions) -> PreparedImage:
    """`prepare_image` and the image's original size, or raise SkipSample."""
    if not data:
        raise SkipSample("empty_file")
    head = sniff(data)
    if head is not None:
        _check_size(head.width, head.height, opts)
        if head.passthrough and opts.verify == "header" and _target(head.width, head.height, opts) is None:
            return PreparedImage(data, head.width, head.height, (), head.width, head.height)
    return _prepare_with_pil(data, head, opts)


def _check_size(width: int, height: int, opts: ImageOptions) -> None:
    if width * height > opts.max_pixels:
        raise SkipSample("too_many_pixels")
    if min(width, height) < max(opts.min_side, 1):
        raise SkipSample("filtered_min_side" if min(width, height) else "not_an_image")


def _target(width: int, height: int, opts: ImageOptions) -> tuple[int, int] | None:
    """Final (width, height) when the image must change size or shape, else None."""
    short = min(width, height)
    if opts.resize_max and short > opts.resize_max:
        scale = opts.resize_max / short
        width, height = max(1, round(width * scale)), max(1, round(height * scale))
    elif not (opts.center_crop and width != height):
        return None
    if opts.center_crop:
        side = min(width, height)
        return side, side
    return width, height


def _open(data: bytes) -> Image.Image:
    try:
        return Image.open(io.BytesIO(data))
    except Exception:  # PIL's format parsers raise many exception types on hostile headers
        raise SkipSample("not_an_image") from None


def _prepare_with_pil(data: bytes, head: Header | None, opts: ImageOptions):
    # PIL's own bomb check (a warning, then an error at twice its default) would override --max-pixels;
    # ours runs right after open, from the header, before any pixel is decoded.
    pil_limit, Image.MAX_IMAGE_PIXELS = Image.MAX_IMAGE_PIXELS, None
    try:
        return _decode(data, head, opts)
    finally:
        Image.MAX_IMAGE_PIXELS = pil_limit


def _decode(data: bytes, head: Header | None, opts: ImageOptions):
    image = _open(data)
    source_format, (width, height) = (image.format or "").upper(), image.size
    _check_size(width, height, opts)
    repairs = _repairs(image, head)
    orientation = _orientation(image)
    if orientation != 1:
        repairs.append("exif_orientation")
    turned = orientation in (5, 6, 7, 8)
    target = _target(height, width, opts) if turned else _target(width, height, opts)
    if target is not None and image.format == "JPEG":
        # Let libjpeg decode at a reduced scale, still at least twice the target (as Image.thumbnail
        # does), so the final high-quality resize sees enough pixels at a fraction of the decode cost.
        want = (target[1], target[0]) if turned else target
        image.draft(None, (2 * want[0], 2 * want[1]))
    try:
        image.load()
    except Exception as err:  # a decoder meeting hostile data can raise nearly anything
        raise SkipSample("truncated_image" if "truncat" in str(err).lower() else "corrupt_image") from None
    if not repairs and target is None:
        return PreparedImage(data, width, height, (), width, height)
    if orientation != 1:
        image = ImageOps.exif_transpose(image)
    # The size read before the draft decode shrank the image, turned upright.
    original = (height, width) if turned else (width, height)
    if opts.center_crop:
        original = (min(original),) * 2
    image = to_rgb(image)
    if target is not None:
        image = _resize_crop(image, target, opts.center_crop)
    stored = encode(image, source_format, opts)
    return PreparedImage(stored, image.width, image.height, tuple(repairs), *original)


def _repairs(image: Image.Image, head: Header | None) -> list[str]:
    mode = image.mode
    if mode == "CMYK":
        return ["cmyk"]
    if (head is not None and head.bits > 8) or mode.startswith("I") or mode == "F":
        return ["16bit"]
    if mode in ALPHA_MODES or (mode == "P" and "transparency" in image.info):
        return ["transparency"]
    if mode not in PASS_MODES:
        return [f"mode_{mode}"]
    return []


def _orientation(image: Image.Image) -> int:
    try:
        value = image.getexif().get(ORIENTATION_TAG, 1)
    except Exception:  # a broken EXIF block means no usable orientation, not a broken image
        return 1
    return value if value in range(1, 9) else 1


def to_rgb(image: Image.Image) -> Image.Image:
    """8-bit RGB: transparency composited on white, 16-bit grey scaled down rather than clipped."""
    mode = image.mode
    if mode == "RGB":
        return image
    if mode.startswith("I") or mode == "F":
        pixels = np.asarray(image).astype(np.float64)
        full = 65535.0 if mode.startswith("I;16") or pixels.max(initial=0) > 255 else 255.0
        grey = np.clip(np.rint(pixels * (255.0 / full)), 0, 255).astype(np.uint8)
        return Image.fromarray(grey, "L").convert("RGB")
    if mode in ALPHA_MODES or "transparency" in image.info:
        rgba = image.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    return image.convert("RGB")


def _resize_crop(image: Image.Image, target: tuple[int, int], center_crop: bool) -> Image.Image:
    width, height = image.size
    if center_crop:
        side = min(width, height)
        left, top = (width - side) // 2, (height - side) // 2
        image = image.crop((left, top, left + side, top + side))
    if image.size != target:
        image = image.resize(target, Image.Resampling.LANCZOS)
    return image


def encode(image: Image.Image, source_format: str, opts: ImageOptions) -> bytes:
    fmt = opts.encode_format
    if fmt == "auto":
        fmt = "png" if source_format in LOSSLESS_FORMATS else "jpeg"
    out = io.BytesIO()
    if fmt == "jpeg":
        image.save(out, "JPEG", quality=opts.encode_quality)
    elif fmt == "webp":
        image.save(out, "WEBP", quality=opts.encode_quality)
    else:
        image.save(out, "PNG", compress_level=3)
    return out.getvalue()
