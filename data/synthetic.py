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
# Drawn and judged, but never in the base training data (write_shapes_folder's default): the demo's
# LoRA stage (demo/lora_stage.py) teaches the trained model this shape as a concept it never saw. A
# plus sign whose arms are a third of its box: the VAE decodes it (its strokes are as wide as a small
# triangle's tip region) and its box-fill ratio, 5/9, sits between the triangle's and the circle's.
NEW_SHAPES = ("cross",)


def draw_shape(color: str, shape: str, size: int, rng: random.Random, noisy_background: bool = False):
    """One RGB image of `shape` in `color` on a light background, at a random place and scale."""
    bg = Image.new("RGB", (size, size), (235, 235, 235))
    if noisy_background:
        bg = Image.effect_noise((size, size), 24).convert("RGB")
        bg = Image.blend(bg, Image.new("RGB", (size, size), (235, 235, 235)), 0.7)
    draw = ImageDraw.Draw(bg)
    # A cross is drawn larger: the tiny VAE (8x8 latents of 32 px) blurs one under ~19 px into a blob
    # that reads as a circle (15% of its reconstructions at the base shapes' scale, none at this one).
    low, high = (0.6, 0.85) if shape in NEW_SHAPES else (0.45, 0.8)
    extent = rng.uniform(low, high) * size
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
    elif shape == "cross":
        third = extent / 3
        draw.rectangle((x0 + third, y0, x0 + 2 * third, y0 + extent), fill=fill)
        draw.rectangle((x0, y0 + third, x0 + extent, y0 + 2 * third), fill=fill)
    else:
        raise ValueError(f"unknown shape {shape!r}; choose one of {SHAPES + NEW_SHAPES}")
    return bg


def write_shapes_folder(
    out: str | Path, n: int, size: int = 32, seed: int = 0, shapes: tuple[str, ...] = SHAPES
) -> Path:
    """Write `n` PNGs with same-stem .txt captions to `out` (an image folder for `convert folder`), of
    random colours and `shapes` (the base set by default: the same images as before NEW_SHAPES)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    for i in range(n):
        color = rng.choice(list(COLORS))
        shape = rng.choice(shapes)
        image = draw_shape(color, shape, size, rng, noisy_background=rng.random() < 0.3)
        image.save(out / f"{i:06d}.png")
        (out / f"{i:06d}.txt").write_text(f"a {color} {shape}")
    return out
