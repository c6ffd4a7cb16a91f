"""Inputs for the converter tests, made here with PIL: photos, hostile files, img2dataset-shaped shards,
COCO folders and a loopback HTTP server. Every generator is deterministic."""

import http.server
import io
import json
import socketserver
import tarfile
import threading
import zlib
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from PIL import Image


def photo(width: int, height: int, seed: int = 0) -> Image.Image:
    """Smooth gradients plus a few blocks: survives JPEG well, and any flip or rotation shows."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width].astype(np.float64)
    base = rng.uniform(20, 90, size=3)
    pixels = np.stack(
        [
            base[c] + 120 * x / max(width, 1) * (c != 2) + 120 * y / max(height, 1) * (c != 0)
            for c in range(3)
        ],
        -1,
    )
    for _ in range(3):
        x0, y0 = rng.integers(0, max(width // 2, 1)), rng.integers(0, max(height // 2, 1))
        pixels[y0 : y0 + height // 4, x0 : x0 + width // 4] = rng.uniform(0, 255, size=3)
    return Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8), "RGB")


def encode(image: Image.Image, fmt: str = "JPEG", **kwargs) -> bytes:
    out = io.BytesIO()
    if fmt == "JPEG":
        kwargs.setdefault("quality", 95)
    image.save(out, fmt, **kwargs)
    return out.getvalue()


def jpeg(width: int = 48, height: int = 32, seed: int = 0) -> bytes:
    return encode(photo(width, height, seed))


def pixels(data: bytes) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(data)).convert("RGB"), dtype=np.float64)


def close(a: np.ndarray, b: np.ndarray, tol: float = 4.0) -> bool:
    """Same shape and a small mean absolute difference (JPEG round trips are not exact)."""
    return a.shape == b.shape and float(np.abs(a - b).mean()) < tol


def exif_rotated_jpeg(width: int = 40, height: int = 24, seed: int = 0, orientation: int = 6) -> bytes:
    exif = Image.Exif()
    exif[0x0112] = orientation
    return encode(photo(width, height, seed), exif=exif.tobytes())


def png_bomb_header(side: int = 40_000) -> bytes:
    """A PNG whose header claims side x side pixels: what a decompression bomb looks like up front."""

    def chunk(kind: bytes, body: bytes) -> bytes:
        return len(body).to_bytes(4, "big") + kind + body + zlib.crc32(kind + body).to_bytes(4, "big")

    ihdr = side.to_bytes(4, "big") * 2 + bytes([8, 2, 0, 0, 0])
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", ihdr)
        + chunk(b"IDAT", zlib.compress(b"\0" * 64))
        + chunk(b"IEND", b"")
    )


def hostile_images() -> dict[str, tuple[bytes, str]]:
    """name -> (file bytes, the skip reason the converter must give)."""
    good = jpeg(64, 48, seed=7)
    return {
        "truncated_jpeg": (good[: len(good) // 2], "truncated_image"),
        "zero_byte": (b"", "empty_file"),
        "not_an_image": (b"<html><body>404 not found</body></html>", "not_an_image"),
        "bomb": (png_bomb_header(), "too_many_pixels"),
    }


def repairable_images() -> dict[str, tuple[bytes, np.ndarray, str]]:
    """name -> (file bytes, expected RGB pixels after repair, repair reason)."""
    rgb = np.asarray(photo(32, 24, seed=3))
    cmyk = encode(Image.fromarray(rgb).convert("CMYK"), "JPEG")
    grey16 = (np.arange(32 * 24, dtype=np.uint32).reshape(24, 32) * 85).astype(np.uint16)  # up to 65195
    grey16_png = encode(Image.fromarray(grey16, "I;16"), "PNG")
    palette = Image.fromarray(rgb).quantize(8)
    palette_png = encode(palette, "PNG", transparency=0)
    opaque = np.asarray(palette.convert("RGB"), dtype=np.float64)
    see_through = (np.asarray(palette) == 0)[..., None]
    la = np.stack([rgb[..., 0], np.linspace(0, 255, 32 * 24).reshape(24, 32).astype(np.uint8)], -1)
    alpha = la[..., 1:].astype(np.float64) / 255
    rotated = exif_rotated_jpeg(40, 24, seed=5)
    return {
        "cmyk": (cmyk, np.asarray(Image.open(io.BytesIO(cmyk)).convert("RGB"), dtype=np.float64), "cmyk"),
        "grey16": (grey16_png, np.repeat(np.rint(grey16 / 257.0)[..., None], 3, -1), "16bit"),
        "palette_transparent": (palette_png, np.where(see_through, 255.0, opaque), "transparency"),
        "la": (
            encode(Image.fromarray(la, "LA"), "PNG"),
            np.repeat(la[..., :1] * alpha + 255 * (1 - alpha), 3, -1),
            "transparency",
        ),
        "exif_rotated": (rotated, np.rot90(pixels(encode(photo(40, 24, seed=5))), k=-1), "exif_orientation"),
    }


# --- img2dataset output -------------------------------------------------------------------------


def i2d_json(key: str, caption, url: str = "", **meta) -> bytes:
    record = {
        "url": url or f"http://example.invalid/{key}.jpg",
        "caption": caption,
        "key": key,
        "status": "success",
        "error_message": None,
        "width": None,
        "height": None,
        **meta,
    }
    return json.dumps(record).encode()


def write_tar(path: Path, members: list) -> Path:
    """members: (name, bytes) for files, or a ready TarInfo (links, devices) with None."""
    with tarfile.open(path, "w", format=tarfile.GNU_FORMAT) as tar:
        for name, data in members:
            if isinstance(name, tarfile.TarInfo):
                tar.addfile(name)
                continue
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def sample_members(key: str, image: bytes, caption, ext: str = "jpg", **meta) -> list:
    txt = caption if isinstance(caption, bytes) else ("" if caption is None else str(caption)).encode()
    return [
        (f"{key}.{ext}", image),
        (f"{key}.txt", txt),
        (f"{key}.json", i2d_json(key, caption if not isinstance(caption, bytes) else None, **meta)),
    ]


def write_stats(folder: Path, shard: str, count: int) -> None:
    (folder / f"{shard}_stats.json").write_text(json.dumps({"count": count, "successes": count}))


def write_parquet(path: Path, rows: list[dict]) -> Path:
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def make_i2d_tars(folder: Path, shards: int, per_shard: int, size=(48, 32)) -> dict[str, tuple[bytes, str]]:
    """Clean img2dataset webdataset shards; returns key -> (image bytes, caption)."""
    folder.mkdir(parents=True, exist_ok=True)
    expected = {}
    for s in range(shards):
        members = []
        for i in range(per_shard):
            key = f"{s:05d}{i:04d}"
            image, caption = jpeg(*size, seed=s * 1000 + i), f"photo {key} of a thing"
            members += sample_members(
                key,
                image,
                caption,
                similarity=0.3 + i / 1000,
                punsafe=0.01,
                pwatermark=0.2,
                AESTHETIC_SCORE=5.5,
            )
            expected[key] = (image, caption)
        write_tar(folder / f"{s:05d}.tar", members)
        write_stats(folder, f"{s:05d}", per_shard)
    return expected


# --- loopback HTTP --------------------------------------------------------------------------------


@contextmanager
def serve_folder(folder: Path):
    """Serve `folder` over HTTP on 127.0.0.1 (a free port); yields the base URL."""

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, directory=str(folder), **kwargs)

        def log_message(self, *args):
            pass

    class Server(socketserver.ThreadingMixIn, http.server.HTTPServer):
        daemon_threads = True

    server = Server(("127.0.0.1", 0), Quiet)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def read_mds(local: Path, remote: str | None = None) -> list[dict]:
    """Every row of an MDS dataset, in order, read back with our StreamingDataset."""
    from data.streaming_base import StreamingBase

    dataset = StreamingBase(local=str(local), remote=remote, shuffle=False, batch_size=1)
    rows = [dataset[i] for i in range(len(dataset))]
    del dataset
    return rows


def run_cli(*argv) -> int:
    from convert.__main__ import main

    return main([str(a) for a in argv] + ["--no-progress"])


def done_markers(out: Path) -> list[Path]:
    """The completion markers a conversion wrote, as convert.pipeline reads them: not the dot-named
    temporary a marker is written to before its rename (which pathlib's `*` matches too; a kill between
    the two once counted a marker that was not there)."""
    return [p for p in (out / "_done").glob("*.json") if not p.name.startswith(".")]
