"""The pixel classifier that judges the demo's samples, tested on real synthetic images."""

import random

import numpy as np
import torch

from data.synthetic import COLORS, NEW_SHAPES, SHAPES, draw_shape, write_shapes_folder
from demo.classifier import accuracy, classify, parse_caption
from demo.judge import judge


def _images(n: int, seed: int):
    rng = random.Random(seed)
    for _ in range(n):
        color, shape = rng.choice(list(COLORS)), rng.choice(SHAPES)
        yield draw_shape(color, shape, 32, rng, noisy_background=rng.random() < 0.3), f"a {color} {shape}"


def test_right_on_every_real_image():
    images, captions = zip(*_images(600, seed=5), strict=True)
    assert accuracy(images, captions) == {"color": 1.0, "shape": 1.0, "both": 1.0}


def test_wrong_answers_are_caught():
    rng = random.Random(0)
    red_circle = draw_shape("red", "circle", 32, rng)
    assert classify(red_circle) == ("red", "circle")
    assert accuracy([red_circle], ["a blue circle"]) == {"color": 0.0, "shape": 1.0, "both": 0.0}
    assert accuracy([red_circle], ["a red triangle"])["shape"] == 0.0
    blank = np.full((32, 32, 3), 235, dtype=np.uint8)  # nothing drawn: no colour, no shape
    assert classify(blank) == (None, None)
    assert parse_caption("A Yellow Square") == ("yellow", "square")


def test_judge_takes_generated_tensors():
    pil, captions = zip(*_images(24, seed=9), strict=True)
    tensors = torch.stack([torch.from_numpy(np.array(p)).permute(2, 0, 1).float() / 255 for p in pil])
    rows, acc = judge(tensors, list(captions))
    assert acc["both"] == 1.0 and [r["prompt"] for r in rows] == list(captions)
    shuffled = list(captions[1:]) + [captions[0]]
    assert judge(tensors, shuffled)[1]["both"] < 1.0


def test_the_lora_stages_cross_is_judged_and_never_in_the_base_data(tmp_path):
    """demo/lora_stage.py teaches the cross (NEW_SHAPES): the classifier must read real crosses right,
    and the base set (write_shapes_folder's default) must never hold one."""
    rng = random.Random(11)
    crosses = [
        (draw_shape(c, "cross", 32, rng, rng.random() < 0.3), f"a {c} cross")
        for c in COLORS
        for _ in range(50)
    ]
    images, captions = zip(*crosses, strict=True)
    assert accuracy(images, captions) == {"color": 1.0, "shape": 1.0, "both": 1.0}
    assert parse_caption("a blue cross") == ("blue", "cross") and "cross" in NEW_SHAPES
    folder = write_shapes_folder(tmp_path, 200)
    assert not any("cross" in p.read_text() for p in folder.glob("*.txt"))
