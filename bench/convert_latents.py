"""Latents benchmark: `sd-convert latents` in 2 processes against 1, on the CPU, tiny preset.

    python bench/convert_latents.py [--samples 512] [--inputs 8] [--size 96x64] [--resolution 64] \
        [--repeats 3]

Input: an MDS image-caption set of distinct JPEG photos, written by the folder converter in
--inputs inputs (made here, in a temp folder). Variants (each timed end to end: forking the workers,
building the encoders in each, reading, encoding, writing, markers and merge; interleaved so
background load hits both alike; best of --repeats):
  1-process    convert_latents(..., workers=1)
  2-processes  convert_latents(..., workers=2): the fork pool of convert.pipeline, one torch thread each
Every process runs one torch thread (OMP_NUM_THREADS=1), so the ratio is what a second process adds;
on GPUs each process takes its own device instead. Prints a markdown table and the ratio.
"""

import argparse
import logging
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from PIL import Image

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

from convert import folder  # noqa: E402
from convert.common import BASE_COLUMNS  # noqa: E402
from convert.latents import convert_latents  # noqa: E402
from convert.pipeline import convert  # noqa: E402
from convert.samples import Options  # noqa: E402


def make_source(root: Path, samples: int, inputs: int, size: tuple[int, int]) -> Path:
    """Distinct photo-like JPEGs with captions -> an MDS set of `inputs` inputs (folder source)."""
    rng = np.random.default_rng(0)
    w, h = size
    y, x = np.mgrid[0:h, 0:w].astype(np.float32)
    images = root / "images"
    images.mkdir()
    for i in range(samples):
        a, b, c = rng.uniform(0.2, 1.5, 3)
        pixels = np.stack([a * x / w * 200, b * y / h * 200, c * (x + y) / (w + h) * 200], -1)
        pixels += rng.normal(0, 12, pixels.shape)
        Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8)).save(images / f"{i:06d}.jpg", quality=90)
        (images / f"{i:06d}.txt").write_text(f"a synthetic photo number {i} with a caption of typical length")
    src = root / "src"
    parts = folder.parts(images, part_size=-(-samples // inputs))
    convert(parts, str(src), Options(), BASE_COLUMNS, work_dir=root / "work", progress=False)
    return src


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--samples", type=int, default=512)
    parser.add_argument("--inputs", type=int, default=8, help="inputs of the source set (at least 2)")
    parser.add_argument("--size", default="96x64", help="photo size WxH")
    parser.add_argument("--resolution", type=int, default=64, help="--resolutions (one)")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    size = tuple(int(v) for v in args.size.split("x"))
    torch.set_num_threads(1)

    root = Path(tempfile.mkdtemp(prefix="bench-latents-"))
    logging.getLogger("convert.latents").setLevel(logging.ERROR)  # the random-weights warning, every run
    try:
        src = make_source(root, args.samples, args.inputs, size)
        print(
            f"{args.samples} JPEG photos {args.size} in {args.inputs} inputs -> latents at "
            f"{args.resolution} px, tiny preset, batch {args.batch_size}, CPU",
            file=sys.stderr,
        )
        variants = {"1-process": 1, "2-processes": 2}
        best = {name: float("inf") for name in variants}
        for repeat in range(args.repeats):
            for name, workers in variants.items():
                out = root / f"out-{name}"
                shutil.rmtree(out, ignore_errors=True)
                started = time.perf_counter()
                report = convert_latents(
                    str(src), str(out), [args.resolution], "tiny", batch_size=args.batch_size,
                    device="cpu", workers=workers, work_dir=root / "work", progress=False,
                )  # fmt: skip
                best[name] = min(best[name], time.perf_counter() - started)
                assert report["samples_written"] == args.samples, (name, report["samples_written"])
            print(f"  repeat {repeat + 1}/{args.repeats} done", file=sys.stderr)
    finally:
        shutil.rmtree(root, ignore_errors=True)

    rate = {name: args.samples / seconds for name, seconds in best.items()}
    print(f"| variant | seconds | samples/s (best of {args.repeats}) |\n|---|---:|---:|")
    for name in variants:
        print(f"| {name} | {best[name]:.2f} | {rate[name]:,.0f} |")
    print(f"\n2 processes / 1 = {rate['2-processes'] / rate['1-process']:.2f} (cpus: {os.cpu_count()})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
