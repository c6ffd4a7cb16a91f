"""`folder` source: images with a same-stem caption file (`.txt`, or `.json` with a caption field).

The sorted image list is cut into inputs of `part_size` images, so a big folder converts in parallel
and restarts at input granularity. Keys are the paths relative to --src without the extension.
"""

import json
from collections.abc import Iterator
from pathlib import Path

from convert.common import (
    BASE_COLUMNS,
    MAX_FILE_BYTES,
    ConvertError,
    Part,
    Skipped,
    chunk_name,
    readable_folder,
)
from convert.samples import Options, pick_metadata, prepare

IMAGE_SUFFIXES = {".jpg", ".jpeg", ".png", ".webp", ".bmp", ".gif", ".tif", ".tiff"}
CAPTION_FIELDS = ("caption", "text", "txt")
PART_SIZE = 10_000


def parts(src: str | Path, part_size: int = PART_SIZE) -> list[Part]:
    src = readable_folder(src)
    files = sorted(
        p.relative_to(src).as_posix() for p in src.rglob("*") if p.suffix.lower() in IMAGE_SUFFIXES
    )
    if not files:
        raise ConvertError(f"--src {src}: no images ({', '.join(sorted(IMAGE_SUFFIXES))}) found")
    chunks = [files[i : i + part_size] for i in range(0, len(files), part_size)]
    return [Part(chunk_name(i), read_files, (str(src), chunk), len(chunk)) for i, chunk in enumerate(chunks)]


def read_file(path: Path) -> bytes | str:
    """The file's bytes, or the skip reason."""
    try:
        if path.stat().st_size > MAX_FILE_BYTES:
            return "file_too_large"
        return path.read_bytes()
    except OSError:
        return "unreadable_file"


def read_caption(image_path: Path) -> tuple[object, dict] | str:
    """(raw caption, metadata) from the image's .txt or .json; the caption is None when neither has one.
    A .json that does not parse as an object is `bad_json` when it is where the caption comes from
    (no .txt), as for img2dataset's; beside a .txt it is metadata only, and read as none."""
    meta, problem = {}, None
    sidecar = image_path.with_suffix(".json")
    if sidecar.is_file():
        try:
            loaded = json.loads(sidecar.read_bytes())
        except OSError:
            loaded, problem = None, "unreadable_file"
        except (ValueError, UnicodeDecodeError):
            loaded = None
        meta = loaded if isinstance(loaded, dict) else {}
        problem = problem or (None if isinstance(loaded, dict) else "bad_json")
    txt = image_path.with_suffix(".txt")
    if txt.is_file():
        caption = read_file(txt)
        return (None if isinstance(caption, str) else caption), meta
    if problem:
        return problem
    lowered = {str(k).lower(): v for k, v in meta.items()}
    return next((lowered[f] for f in CAPTION_FIELDS if f in lowered), None), meta


def read_files(src: str, rel_paths: list[str]) -> Iterator[dict | Skipped]:
    root = Path(src)
    for rel in rel_paths:
        path = root / rel
        key = rel.rsplit(".", 1)[0]
        if not path.is_file():
            yield Skipped(key, "not_a_file")
            continue
        read = read_caption(path)
        if isinstance(read, str):
            yield Skipped(key, read)
            continue
        caption, meta = read
        data = read_file(path)
        if isinstance(data, str):
            yield Skipped(key, data)
            continue
        yield {**pick_metadata(meta), "key": key, "image": data, "caption": caption}


def iter_samples(src: str | Path, options: Options | None = None) -> Iterator[dict | Skipped]:
    """Every image of `src` as a row with the base columns, in sorted order, or a Skipped."""
    options = options or Options()
    inputs = parts(src)  # now, not at the first next(): a bad --src fails before anything is written
    return (_row(raw, options) for part in inputs for raw in part.samples())


def _row(raw, options: Options) -> dict | Skipped:
    result = raw if isinstance(raw, Skipped) else prepare(raw, options, BASE_COLUMNS)
    return result if isinstance(result, Skipped) else result[0]
