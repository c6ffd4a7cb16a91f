"""Does a model trained on the synthetic shapes draw what its prompt asks for?

    python -m demo.judge CHECKPOINT_OR_DIR --out runs/demo/eval [--per-prompt 6] [--seed 0]

Generates `per_prompt` images for every "a {colour} {shape}" prompt (EMA weights when the checkpoint
has them), judges each with the deterministic pixel classifier of demo/classifier.py, and
writes every image as its own PNG plus `manifest.json` beside them: a list of
{"prompt", "color", "shape", "file"}, where color and shape are what the classifier saw (null when
it found no shape) and file is relative to the manifest. `accuracy.json` holds the fractions.
"""

import argparse
import json
import logging
from pathlib import Path

import torch
from torchvision.utils import save_image

from data.synthetic import COLORS, SHAPES
from demo.classifier import classify, score

log = logging.getLogger(__name__)

PROMPTS = [f"a {color} {shape}" for color in COLORS for shape in SHAPES]
# Sampling settings of the demo's measurement (the family's sampler: DDIM for the UNet, Euler for
# the transformer). Guidance 4 and 25 steps: at this size more steps changed nothing measurable.
GUIDANCE, STEPS = 4.0, 25


def judge(images: torch.Tensor, prompts: list[str]) -> tuple[list[dict], dict[str, float]]:
    """Per-image verdicts and the accuracies (colour, shape, both) of `images` (N, 3, H, W) in [0, 1]."""
    verdicts = [classify(image) for image in images]
    rows = [{"prompt": p, "color": c, "shape": s} for p, (c, s) in zip(prompts, verdicts, strict=True)]
    return rows, score(verdicts, prompts)


def evaluate(
    model, out_dir: str | Path, per_prompt: int = 6, seed: int = 0, prompts: list[str] = PROMPTS
) -> dict:
    """Generate, judge and write the images of every prompt (all 12 by default); return accuracies
    and paths."""
    from models.generate import sample_grid

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    images = sample_grid(
        model, prompts, per_prompt, seed=seed, guidance_scale=GUIDANCE, num_inference_steps=STEPS
    )
    rows, accuracy = judge(images, [p for p in prompts for _ in range(per_prompt)])  # prompt-major
    for i, (row, image) in enumerate(zip(rows, images, strict=True)):
        row["file"] = f"{i:03d}-{row['prompt'].removeprefix('a ').replace(' ', '-')}.png"
        save_image(image, out_dir / row["file"])
    manifest = out_dir / "manifest.json"
    manifest.write_text(json.dumps(rows, indent=1))
    grid = out_dir / "grid.png"
    save_image(images, grid, nrow=per_prompt, padding=2)
    result = {**accuracy, "images": len(rows), "per_prompt": per_prompt, "seed": seed}
    (out_dir / "accuracy.json").write_text(json.dumps(result, indent=1))
    return {**result, "manifest": manifest, "grid": grid}


def main(argv: list[str] | None = None) -> None:
    from models.checkpoints.checkpoint_file import one_line_errors
    from models.generate import load_model

    prog = "python -m demo.judge"
    parser = argparse.ArgumentParser(
        prog=prog, description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("source", help="a Composer checkpoint of the tiny recipe or an exported folder")
    parser.add_argument("--out", required=True, help="folder for the PNGs, manifest.json and accuracy.json")
    parser.add_argument("--per-prompt", type=int, default=6, help="images per prompt (12 prompts)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the initial noise")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    with one_line_errors(prog):
        model = load_model(args.source)
    result = evaluate(model, args.out, args.per_prompt, args.seed)
    print(
        f"colour accuracy {result['color']:.1%}, shape accuracy {result['shape']:.1%} over "
        f"{result['images']} images\nmanifest: {result['manifest'].resolve()}"
    )


if __name__ == "__main__":
    main()
