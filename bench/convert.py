"""Converter benchmark: `sd-convert img2dataset` against plain loops doing the same work, in one run.

    python bench/convert.py [--samples 2000] [--shards 4] [--size 512x384] [--resize 256] [--repeats 3]

Input: img2dataset-shaped webdataset tars of distinct JPEG photos (made here, in a temp folder).
Variants (each timed end to end, interleaved so background load hits all alike; best of --repeats,
and of 3x that for the no-resize ones, which take about a second each, so one slow disk flush
would otherwise decide their ratio):
  plain-mds     a plain loop over the same tars: tarfile members -> json.loads -> MDSWriter.write, no
                checks (the baseline for the no-resize path; same columns, same compression)
  plain-mds-mem the same loop with every sample already in memory (no tar reading): for reference
  ours          convert.pipeline.convert(...), no resize: header checks, original bytes, markers, merge
  plain-pil     a plain PIL loop over in-memory bytes: open, convert RGB, resize the shorter side to
                --resize (LANCZOS), encode JPEG q95; nothing written (the baseline for the resize path)
  ours-resize   convert(..., resize) with 1 worker, then with 2 workers (reads tars, writes MDS)
Prints a markdown table and the ratios the issue asks for:
  no-resize  ours / plain-mds              >= 0.8
  resize     ours-resize 1 worker / plain-pil   >= 0.9 (per worker)
  scaling    ours-resize 2 workers / 1 worker   >= 1.7
"""

import argparse
import io
import json
import os
import shutil
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import numpy as np
from PIL import Image

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
os.environ.setdefault("OMP_NUM_THREADS", "1")

from streaming import MDSWriter  # noqa: E402

from convert import img2dataset_src  # noqa: E402
from convert.common import BASE_COLUMNS, LAION_COLUMNS  # noqa: E402
from convert.images import ImageOptions  # noqa: E402
from convert.pipeline import convert  # noqa: E402
from convert.samples import Options  # noqa: E402

COLUMNS = {**BASE_COLUMNS, **LAION_COLUMNS}
META = ("url", "similarity", "punsafe", "pwatermark", "aesthetic")


def make_dataset(root: Path, samples: int, shards: int, size: tuple[int, int]) -> list[tuple[bytes, str]]:
    """Distinct photo-like JPEGs (gradients, blocks, noise) in img2dataset tars; returns (image, caption)."""
    rng = np.random.default_rng(0)
    w, h = size
    y, x = np.mgrid[0:h, 0:w].astype(np.float32)
    per_shard, items = samples // shards, []
    for s in range(shards):
        with tarfile.open(root / f"{s:05d}.tar", "w") as tar:
            for i in range(per_shard):
                key = f"{s:05d}{i:04d}"
                a, b, c = rng.uniform(0.2, 1.5, 3)
                pixels = np.stack([a * x / w * 200, b * y / h * 200, c * (x + y) / (w + h) * 200], -1)
                pixels += rng.normal(0, 12, pixels.shape)
                out = io.BytesIO()
                Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8)).save(out, "JPEG", quality=90)
                caption = f"a synthetic photo number {key} with a caption of typical length for LAION"
                meta = {
                    "url": f"http://example.invalid/{key}.jpg",
                    "caption": caption,
                    "key": key,
                    "status": "success",
                    "width": w,
                    "height": h,
                    "similarity": 0.3,
                    "punsafe": 0.01,
                    "pwatermark": 0.1,
                    "AESTHETIC_SCORE": 5.5,
                }
                for ext, data in (
                    ("jpg", out.getvalue()),
                    ("txt", caption.encode()),
                    ("json", json.dumps(meta).encode()),
                ):
                    info = tarfile.TarInfo(f"{key}.{ext}")
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
                items.append((out.getvalue(), caption))
        (root / f"{s:05d}_stats.json").write_text("{}")
    return items


def plain_mds(src: Path, out: Path) -> int:
    n = 0
    with MDSWriter(out=str(out), columns=COLUMNS, compression=None) as writer:
        for path in sorted(src.glob("*.tar")):
            with tarfile.open(path) as tar:
                group = {}
                for member in tar:
                    key, ext = member.name.split(".", 1)
                    group[ext] = tar.extractfile(member).read()
                    if len(group) == 3:
                        meta = json.loads(group["json"])
                        row = {
                            "image": group["jpg"],
                            "caption": group["txt"].decode(),
                            "key": key,
                            "width": meta["width"],
                            "height": meta["height"],
                            "url": meta["url"],
                            "similarity": meta["similarity"],
                            "punsafe": meta["punsafe"],
                            "pwatermark": meta["pwatermark"],
                            "aesthetic": meta["AESTHETIC_SCORE"],
                        }
                        writer.write(row)
                        group, n = {}, n + 1
    return n


def plain_mds_memory(rows: list[dict], out: Path) -> int:
    with MDSWriter(out=str(out), columns=COLUMNS, compression=None) as writer:
        for row in rows:
            writer.write(row)
    return len(rows)


def plain_pil(items: list[tuple[bytes, str]], side: int) -> int:
    for data, _ in items:
        image = Image.open(io.BytesIO(data)).convert("RGB")
        w, h = image.size
        scale = side / min(w, h)
        image = image.resize((round(w * scale), round(h * scale)), Image.Resampling.LANCZOS)
        image.save(io.BytesIO(), "JPEG", quality=95)
    return len(items)


def ours(src: Path, out: Path, work: Path, resize: int | None, workers: int) -> int:
    options = Options(image=ImageOptions(resize_max=resize))
    parts = img2dataset_src.parts(src)
    report = convert(parts, str(out), options, COLUMNS, workers=workers, work_dir=work, progress=False)
    return report["samples_written"]


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--samples", type=int, default=2000)
    parser.add_argument(
        "--shards", type=int, default=4, help="inputs (tars); at least 2 for the 2-worker run"
    )
    parser.add_argument("--size", default="512x384", help="photo size WxH")
    parser.add_argument("--resize", type=int, default=256, help="--resize-max for the resize path")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    size = tuple(int(v) for v in args.size.split("x"))

    root = Path(tempfile.mkdtemp(prefix="bench-convert-"))
    try:
        src = root / "src"
        src.mkdir()
        items = make_dataset(src, args.samples, args.shards, size)
        n = len(items)
        rows = []
        for i, (data, caption) in enumerate(items):
            rows.append(
                {
                    "image": data,
                    "caption": caption,
                    "key": str(i),
                    "width": size[0],
                    "height": size[1],
                    "url": "http://example.invalid/x.jpg",
                    "similarity": 0.3,
                    "punsafe": 0.01,
                    "pwatermark": 0.1,
                    "aesthetic": 5.5,
                }
            )
        mb = sum(len(d) for d, _ in items) / 2**20
        print(
            f"{n} JPEG photos {args.size} ({mb:.0f} MiB) in {args.shards} tars; resize to {args.resize}",
            file=sys.stderr,
        )
        variants = {
            "plain-mds": lambda out: plain_mds(src, out),
            "plain-mds-mem": lambda out: plain_mds_memory(rows, out),
            "ours": lambda out: ours(src, out, root / "work", None, 1),
            "plain-pil": lambda out: plain_pil(items, args.resize),
            "ours-resize-1w": lambda out: ours(src, out, root / "work", args.resize, 1),
            "ours-resize-2w": lambda out: ours(src, out, root / "work", args.resize, 2),
        }
        best = {name: float("inf") for name in variants}
        quick = {"plain-mds", "plain-mds-mem", "ours"}
        for repeat in range(args.repeats):
            for name, run in variants.items():
                for _ in range(3 if name in quick else 1):
                    out = root / f"out-{name}"
                    shutil.rmtree(out, ignore_errors=True)
                    started = time.perf_counter()
                    count = run(out)
                    best[name] = min(best[name], time.perf_counter() - started)
                    assert count == n, (name, count)
            print(f"  repeat {repeat + 1}/{args.repeats} done", file=sys.stderr)
    finally:
        shutil.rmtree(root, ignore_errors=True)

    rate = {name: n / seconds for name, seconds in best.items()}
    print(f"| variant | samples/s (best of {args.repeats}; no-resize: of {3 * args.repeats}) |\n|---|---:|")
    for name in variants:
        print(f"| {name} | {rate[name]:,.0f} |")
    checks = [
        ("no-resize: ours / plain-mds", rate["ours"] / rate["plain-mds"], 0.8),
        ("resize:    ours-resize-1w / plain-pil", rate["ours-resize-1w"] / rate["plain-pil"], 0.9),
        ("scaling:   ours-resize-2w / ours-resize-1w", rate["ours-resize-2w"] / rate["ours-resize-1w"], 1.7),
    ]
    print()
    for label, ratio, target in checks:
        print(f"{label} = {ratio:.2f} (target >= {target}): {'ok' if ratio >= target else 'MISSED'}")
    in_memory = rate["ours"] / rate["plain-mds-mem"]
    print(f"(for reference: ours / plain-mds-mem = {in_memory:.2f}; cpus: {os.cpu_count()})")
    return 0 if all(ratio >= target for _, ratio, target in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
