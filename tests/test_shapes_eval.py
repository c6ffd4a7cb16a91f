"""demo/judge.py writes one PNG per sample and a manifest that matches them."""

import json
import random

import numpy as np
import torch
from PIL import Image

from data.synthetic import draw_shape
from demo.judge import evaluate


class _Painter:
    """Stands in for a trained model: draws what the prompt asks, except blue is drawn red."""

    def generate(self, prompts, seed=0, **_):
        rng = random.Random(seed)
        images = []
        for prompt in prompts:
            _, color, shape = prompt.split()
            picture = draw_shape("red" if color == "blue" else color, shape, 32, rng)
            images.append(torch.from_numpy(np.array(picture)).permute(2, 0, 1).float() / 255)
        return torch.stack(images)


def test_manifest_lists_every_image_with_what_the_classifier_saw(tmp_path):
    result = evaluate(_Painter(), tmp_path, per_prompt=2)
    assert result["images"] == 24 and result["shape"] == 1.0
    assert result["color"] == 0.75  # the 3 blue prompts of 12 come out red
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert len(manifest) == 24 and set(manifest[0]) == {"prompt", "color", "shape", "file"}
    for row in manifest:
        assert Image.open(tmp_path / row["file"]).size == (32, 32)
        wanted = row["prompt"].split()[1]
        assert row["color"] == ("red" if wanted == "blue" else wanted)
    assert json.loads((tmp_path / "accuracy.json").read_text())["color"] == 0.75
    assert Image.open(result["grid"]).size[0] > 32 * 2
