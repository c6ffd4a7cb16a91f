"""A deterministic pixel classifier for the coloured-shapes data: which colour, which shape.

It judges generated images, so it uses nothing learned:
- foreground = pixels far from the grey axis (max - min channel > `SATURATION`). Both backgrounds
  of data/synthetic.py are grey (plain 235, or noise blended to about 203 +- 7) and every named
  colour has a channel spread of 150 or more, so the split does not depend on the background;
- colour = the named colour nearest (RGB) to the most foreground pixels (a majority vote, so a
  blurred rim does not pull the answer towards a mixture);
- shape = the template (circle, square, apex-up triangle, and the LoRA stage's cross: a plus sign
  with arms a third of the box wide) inscribed in the foreground's bounding box that overlaps the
  mask best (IoU). The fill ratios of the box are 0.785, 1.0, 0.5 and 0.556; the pairwise IoUs of the
  templates are at most 0.79 (circle-square), far enough apart for a few blurry or stray pixels.
On real images from data/synthetic.py it is right on every one of 1,200 samples
(tests/test_shape_classifier.py).
"""

import numpy as np
import torch
from PIL import Image

from data.synthetic import COLORS, NEW_SHAPES, SHAPES

# Channel spread (0-255) above which a pixel is foreground: background spread is 0 (grey), the
# colours' is 150-210, and anti-aliased or decoded rims fall in between.
SATURATION = 60
# Fewer foreground pixels than this (0.8% of a 32x32 image) means "no shape was drawn".
MIN_PIXELS = 8

_PALETTE = np.array([COLORS[c] for c in COLORS], dtype=np.float32)  # (C, 3)
_NAMES = list(COLORS)


def to_array(image) -> np.ndarray:
    """(H, W, 3) float32 in 0-255 from a PIL image, a uint8 array or a (3, H, W) tensor in [0, 1]."""
    if isinstance(image, Image.Image):
        return np.asarray(image.convert("RGB"), dtype=np.float32)
    if isinstance(image, torch.Tensor):
        return image.detach().float().clamp(0, 1).permute(1, 2, 0).cpu().numpy() * 255.0
    array = np.asarray(image, dtype=np.float32)
    return array * 255.0 if array.max() <= 1.0 else array


def foreground_mask(pixels: np.ndarray) -> np.ndarray:
    return (pixels.max(axis=2) - pixels.min(axis=2)) > SATURATION


def _templates(height: int, width: int) -> dict[str, np.ndarray]:
    """The shapes (SHAPES and NEW_SHAPES) filling a height x width box, sampled at pixel centres."""
    y, x = np.mgrid[0:height, 0:width].astype(np.float32) + 0.5
    cx, cy = width / 2, height / 2
    return {
        "circle": ((x - cx) / cx) ** 2 + ((y - cy) / cy) ** 2 <= 1.0,
        "square": np.ones((height, width), dtype=bool),
        "triangle": np.abs(x - cx) <= cx * y / height,  # apex at the top centre, base at the bottom
        # the plus sign: the middle third of the box in either direction
        "cross": (np.abs(x - cx) <= width / 6) | (np.abs(y - cy) <= height / 6),
    }


def classify_shape(mask: np.ndarray) -> str | None:
    if mask.sum() < MIN_PIXELS:
        return None
    rows, cols = np.flatnonzero(mask.any(axis=1)), np.flatnonzero(mask.any(axis=0))
    box = mask[rows[0] : rows[-1] + 1, cols[0] : cols[-1] + 1]
    best, best_iou = None, -1.0
    for name, template in _templates(*box.shape).items():
        iou = (box & template).sum() / (box | template).sum()
        if iou > best_iou:
            best, best_iou = name, iou
    return best


def classify_color(pixels: np.ndarray, mask: np.ndarray) -> str | None:
    if mask.sum() < MIN_PIXELS:
        return None
    fg = pixels[mask]  # (N, 3)
    nearest = ((fg[:, None, :] - _PALETTE[None]) ** 2).sum(axis=2).argmin(axis=1)
    return _NAMES[np.bincount(nearest, minlength=len(_NAMES)).argmax()]


def classify(image) -> tuple[str | None, str | None]:
    """(colour, shape) of one image; None where no foreground was found."""
    pixels = to_array(image)
    mask = foreground_mask(pixels)
    return classify_color(pixels, mask), classify_shape(mask)


def parse_caption(caption: str) -> tuple[str, str]:
    """("red", "circle") from "a red circle"."""
    words = caption.lower().split()
    color = next(w for w in words if w in COLORS)
    shape = next(w for w in words if w in SHAPES + NEW_SHAPES)
    return color, shape


def accuracy(images, captions) -> dict[str, float]:
    """Fractions of `images` whose colour, shape and both match their caption."""
    return score([classify(image) for image in images], captions)


def score(verdicts: list[tuple[str, str]], captions) -> dict[str, float]:
    """Fractions of (colour, shape) verdicts matching their caption in colour, shape and both."""
    hits = {"color": 0, "shape": 0, "both": 0}
    for got, caption in zip(verdicts, captions, strict=True):
        want = parse_caption(caption)
        hits["color"] += got[0] == want[0]
        hits["shape"] += got[1] == want[1]
        hits["both"] += got == want
    n = max(len(captions), 1)
    return {k: v / n for k, v in hits.items()}
