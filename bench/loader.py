"""Data loader benchmark: samples/s of the training dataset against a plain loop and a decode-only
ceiling, in one run.

    python bench/loader.py [--images 400] [--sizes 512x384 1024x768] [--resolution 256]
                           [--workers 1 2] [--batch-size 16] [--repeats 3]

Input, per size: `--images` distinct photo-like JPEGs (gradients and noise, quality 90: 2.8 bits a
pixel) with distinct LAION-like captions (common words, product codes, some non-ASCII), written with
streaming's MDSWriter (`image` the JPEG bytes, `caption`) into a temporary folder.
Variants (interleaved so background load hits all alike; best of --repeats):
  decode    Image.open(...).load() over the in-memory JPEG bytes, one thread: the decode-only ceiling
  plain     a plain one-thread loop over the same in-memory bytes and captions doing the usual steps
            with the usual libraries: decode, convert RGB, torchvision Resize(R), CenterCrop(R), ToTensor,
            Normalize, flip every other image, and the slow transformers CLIPTokenizer
            (models.engine.tokenizer.build_tokenizer) called per caption, padded to 77
  ours-Nw   a torch DataLoader with N workers (batch --batch-size) over
            data.image_caption.ImageCaptionDataset on the MDS set, hflip on: shard read, decode,
            crop/resize, flip, tokenize, collate, and the hand-over to the main process, as training
            runs it. Timed from the first batch to the last (the samples the other workers finished
            before the first batch arrived are not counted), so the workers' start-up is left out.
            Fresh workers and tokenizers every repeat, so no caption is ever tokenized twice by one
            process (on a real set the dataset's token cache never hits; here it would).
The dataset hands over uint8 images; their conversion to [-1, 1] floats is the model's, on the
accelerator (models.engine.pixels.to_float), and is not counted here.
Prints a markdown table and the ratios the issue asks for, per image size:
  per worker  ours-1w / plain >= 2 and ours-2w / (2 x plain) >= 2
  scaling     ours-2w / ours-1w >= 1.7
Exits 1 when one is missed.
"""

import argparse
import io
import os
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[0] = str(REPO)  # not bench/: its convert.py would shadow the convert package
os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402
from PIL import Image  # noqa: E402
from streaming import MDSWriter  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402
from torchvision import transforms  # noqa: E402

from data.image_caption import ImageCaptionDataset  # noqa: E402
from models.engine.tokenizer import build_tokenizer, tokenize  # noqa: E402

WORDS = (
    "a the of and with in on for to by from at photo image picture poster print canvas art painting "
    "drawing illustration vintage modern abstract minimalist landscape portrait closeup close-up view "
    "red blue green yellow black white gray pink purple orange brown gold silver wooden glass metal "
    "cotton leather cat dog horse bird flower tree forest mountain river lake sea beach city street "
    "house room kitchen table chair lamp sofa bed window door car bike train plane boat man woman "
    "girl boy child family couple people women's men's kids shirt dress shoes bag hat jacket ring "
    "necklace watch phone case cover book cake coffee tea wine pizza salad chocolate wedding party "
    "christmas summer winter autumn spring sunset sunrise night morning old new small large big "
    "beautiful cute happy funny cool best top high quality hd 4k stock royalty free vector icon logo "
    "set pack collection design pattern background texture wallpaper 3d isometric cartoon anime"
).split()
EXTRA = ["café", "naïve", "Zürich", "São Paulo", "“quoted”", "it’s", "—", "…", "東京", "日本", "Москва", "🙂"]


def make_caption(rng: random.Random, i: int) -> str:
    """A distinct LAION-like caption: 4 to 30 words, some capitalised, product codes, a little unicode."""
    words = []
    for _ in range(rng.randint(4, 30)):
        roll = rng.random()
        if roll < 0.82:
            word = rng.choice(WORDS)
            words.append(word.capitalize() if rng.random() < 0.15 else word)
        elif roll < 0.93:
            words.append(f"{rng.choice('ABCDEFGHKLMNPRSTX')}{rng.randint(10, 99999)}")
        elif roll < 0.97:
            words.append(rng.choice([",", "-", "|", "&", "(2019)", "#1", "x", "/"]))
        else:
            words.append(rng.choice(EXTRA))
    return " ".join(words) + f" {i}"


def make_set(out: Path, n: int, size: tuple[int, int], seed: int) -> list[tuple[bytes, str]]:
    """`n` distinct photo-like JPEGs of `size` (w, h) and captions, as an MDS set at `out`; returns them."""
    rng, py_rng = np.random.default_rng(seed), random.Random(seed)
    w, h = size
    y, x = np.mgrid[0:h, 0:w].astype(np.float32)
    items = []
    with MDSWriter(out=str(out), columns={"image": "bytes", "caption": "str"}, compression=None) as writer:
        for i in range(n):
            a, b, c = rng.uniform(0.2, 1.5, 3)
            pixels = np.stack([a * x / w * 200, b * y / h * 200, c * (x + y) / (w + h) * 200], -1)
            pixels += rng.normal(0, 12, pixels.shape).astype(np.float32)
            buffer = io.BytesIO()
            Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8)).save(buffer, "JPEG", quality=90)
            item = (buffer.getvalue(), make_caption(py_rng, i))
            writer.write({"image": item[0], "caption": item[1]})
            items.append(item)
    return items


def decode(items: list[tuple[bytes, str]]) -> tuple[int, float]:
    started = time.perf_counter()
    for data, _ in items:
        Image.open(io.BytesIO(data)).load()
    return len(items), time.perf_counter() - started


def plain(items: list[tuple[bytes, str]], resolution: int) -> tuple[int, float]:
    tokenizer = build_tokenizer()  # a fresh one: its per-word BPE cache starts empty every repeat
    transform = transforms.Compose(
        [
            transforms.Resize(resolution),
            transforms.CenterCrop(resolution),
            transforms.ToTensor(),
            transforms.Normalize([0.5], [0.5]),
        ]
    )
    started = time.perf_counter()
    for i, (data, caption) in enumerate(items):
        pixels = transform(Image.open(io.BytesIO(data)).convert("RGB"))
        if i % 2:
            pixels = pixels.flip(-1)
        ids = tokenize(tokenizer, [caption])[0]
        assert pixels.shape == (3, resolution, resolution) and ids.shape == (77,)
    return len(items), time.perf_counter() - started


def ours(mds: Path, resolution: int, workers: int, batch_size: int) -> tuple[int, float]:
    dataset = ImageCaptionDataset(
        tokenizer=build_tokenizer(), resolution=resolution, hflip=True, local=str(mds), shuffle=False,
        batch_size=batch_size,
    )  # fmt: skip
    loader = DataLoader(dataset, batch_size=batch_size, num_workers=workers, drop_last=False)
    batches = iter(loader)
    first = next(batches)
    started = time.perf_counter()
    count = 0
    for batch in batches:
        count += len(batch["input_ids"])
    seconds = time.perf_counter() - started
    assert first["image"].shape[1:] == (3, resolution, resolution), first["image"].shape
    # When the first batch arrives, each of the other workers has about finished one batch too.
    count += len(first["input_ids"]) - workers * batch_size
    del batches, loader, dataset
    return count, seconds


def table(
    rates: dict[str, dict[str, float]], workers: list[int]
) -> tuple[str, list[tuple[str, float, float]]]:
    lines = [
        "| images | variant | samples/s | per worker | per worker / plain | per worker / decode |",
        "|---|---|---:|---:|---:|---:|",
    ]
    checks = []
    for size, rate in rates.items():
        for name, value in rate.items():
            n = int(name[5:-1]) if name.startswith("ours-") else 1
            lines.append(
                f"| {size} | {name} | {value:,.0f} | {value / n:,.0f} | {value / n / rate['plain']:.2f} "
                f"| {value / n / rate['decode']:.2f} |"
            )
            if name.startswith("ours-"):
                checks.append((f"{size} per worker: {name} / ({n} x plain)", value / n / rate["plain"], 2.0))
        if 1 in workers and 2 in workers:
            checks.append((f"{size} scaling:    ours-2w / ours-1w", rate["ours-2w"] / rate["ours-1w"], 1.7))
    return "\n".join(lines), checks


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--images", type=int, default=400, help="images (and captions) per size")
    parser.add_argument("--sizes", nargs="+", default=["512x384", "1024x768"], help="JPEG sizes WxH")
    parser.add_argument("--resolution", type=int, default=256, help="the training resolution")
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2], help="DataLoader workers")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    sizes = {s: tuple(int(v) for v in s.split("x")) for s in args.sizes}
    if args.images < 4 * args.batch_size * max(args.workers):
        parser.error("--images must be at least 4 x --batch-size x the most workers")

    root = Path(tempfile.mkdtemp(prefix="bench-loader-"))
    try:
        items = {}
        for k, (name, size) in enumerate(sizes.items()):
            items[name] = make_set(root / name, args.images, size, seed=k)
            mib = sum(len(d) for d, _ in items[name]) / 2**20
            print(f"{args.images} JPEGs {name} ({mib:.0f} MiB) -> {args.resolution} px", file=sys.stderr)
        variants = {"decode": lambda s: decode(items[s]), "plain": lambda s: plain(items[s], args.resolution)}
        for w in args.workers:
            variants[f"ours-{w}w"] = lambda s, w=w: ours(root / s, args.resolution, w, args.batch_size)
        best = {s: {name: 0.0 for name in variants} for s in sizes}
        for repeat in range(args.repeats):
            for s in sizes:
                for name, run in variants.items():
                    count, seconds = run(s)
                    best[s][name] = max(best[s][name], count / seconds)
            print(f"  repeat {repeat + 1}/{args.repeats} done", file=sys.stderr)
    finally:
        shutil.rmtree(root, ignore_errors=True)

    text, checks = table(best, args.workers)
    print(f"samples/s, best of {args.repeats}; {os.cpu_count()} cpus\n")
    print(text)
    print()
    for label, ratio, target in checks:
        print(f"{label} = {ratio:.2f} (target >= {target}): {'ok' if ratio >= target else 'MISSED'}")
    return 0 if all(ratio >= target for _, ratio, target in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
