"""Synthetic image-caption data: coloured shapes with captions like "a red circle".

Small, fully known data for the demo and tests: a model that learns from it should draw the colour
and shape its prompt names, which a simple pixel classifier can check. Only the drawing lives here;
recipes/prepare.py turns it into an MDS dataset (`data.train.prepare: shapes`).
"""

import random
from pathlib import Path

from PIL import Image, ImageDraw

COLORS = {
    "red": (220, 30, 30),
    "green": (30, 180, 40),
    "blue": (30, 60, 220),
    "yellow": (240, 220, 30),
}
SHAPES = ("circle", "square", "triangle")


def draw_shape(color: str, shape: str, size: int, rng: random.Random, noisy_background: bool = False):
    """One RGB image of `shape` in `color` on a light background, at a random place and scale."""
    bg = Image.new("RGB", (size, size), (235, 235, 235))
    if noisy_background:
        bg = Image.effect_noise((size, size), 24).convert("RGB")
        bg = Image.blend(bg, Image.new("RGB", (size, size), (235, 235, 235)), 0.7)
    draw = ImageDraw.Draw(bg)
    extent = rng.uniform(0.45, 0.8) * size
    x0 = rng.uniform(0, size - extent)
    y0 = rng.uniform(0, size - extent)
    box = (x0, y0, x0 + extent, y0 + extent)
    fill = COLORS[color]
    if shape == "circle":
        draw.ellipse(box, fill=fill)
    elif shape == "square":
        draw.rectangle(box, fill=fill)
    elif shape == "triangle":
        draw.polygon([(x0 + extent / 2, y0), (x0, y0 + extent), (x0 + extent, y0 + extent)], fill=fill)
    else:
        raise ValueError(f"unknown shape {shape!r}; choose one of {SHAPES}")
    return bg


def write_shapes_folder(out: str | Path, n: int, size: int = 32, seed: int = 0) -> Path:
    """Write `n` PNGs with same-stem .txt captions to `out` (an image folder for `convert folder`)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    for i in range(n):
        color = rng.choice(list(COLORS))
        shape = rng.choice(SHAPES)
        image = draw_shape(color, shape, size, rng, noisy_background=rng.random() < 0.3)
        image.save(out / f"{i:06d}.png")
        (out / f"{i:06d}.txt").write_text(f"a {color} {shape}")
    return out
