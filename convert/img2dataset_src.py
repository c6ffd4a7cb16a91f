"""`img2dataset` source: a folder of img2dataset output, webdataset tars or parquet shards.

- webdataset: `NNNNN.tar` holding `{key}.jpg|png|webp`, `{key}.txt`, `{key}.json` per sample, and a
  `NNNNN.parquet` beside it listing every row (failed downloads too, with their status);
- parquet: `NNNNN.parquet` with the image bytes in a `jpg` (or `png`/`webp`) column, null on failure.
Each shard is one input. When img2dataset's `NNNNN_stats.json` files exist, a shard without one is
still being downloaded and is left for a later run.

Tars are read as a stream and never extracted: member names (`../x`, `/etc/x`) are only strings here,
and members that are not plain files, or have such names, are skipped and counted.
"""

import json
import logging
import tarfile
import zlib
from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from convert.common import (
    MAX_FILE_BYTES,
    ConvertError,
    Part,
    Skipped,
    readable_folder,
    unsafe_path,
)
from convert.samples import pick_metadata

log = logging.getLogger(__name__)

IMAGE_EXTENSIONS = ("jpg", "jpeg", "png", "webp")
FAILURES = {"failed_to_download", "failed_to_resize"}
TOO_LARGE = object()  # stands in for a member too large to read


def parts(src: str | Path, fmt: str = "auto") -> list[Part]:
    src = readable_folder(src)
    tars, parquets = sorted(src.glob("*.tar")), sorted(src.glob("*.parquet"))
    if fmt == "auto":
        fmt = "webdataset" if tars else "parquet"
    if fmt == "webdataset":
        shards = [Part(t.stem, read_tar, (str(t), _sibling(t, ".parquet"))) for t in tars]
    else:
        shards = [Part(p.stem, read_parquet, (str(p),)) for p in parquets if _image_column(p) is not False]
    if not shards:
        raise ConvertError(
            f"--src {src}: no img2dataset shards (NNNNN.tar, or NNNNN.parquet with a jpg column) found"
        )
    if any(src.glob("*_stats.json")):
        unfinished = [p.name for p in shards if not (src / f"{p.name}_stats.json").exists()]
        if unfinished:
            log.warning(
                "leaving out %d shards img2dataset has not finished: %s", len(unfinished), unfinished[:5]
            )
        shards = [p for p in shards if p.name not in unfinished]
    return shards


def _sibling(path: Path, suffix: str) -> str | None:
    other = path.with_suffix(suffix)
    return str(other) if other.exists() else None


def _image_column(path: Path) -> str | None | bool:
    """The image column's name; None if the schema is unreadable (the reader will say so); False if none."""
    try:
        names = pq.read_schema(path).names
    except (pa.ArrowException, OSError):
        return None
    return next((c for c in IMAGE_EXTENSIONS if c in names), False)


def split_name(name: str) -> tuple[str, str]:
    """webdataset's rule: the key is the path up to the first dot of the file name."""
    folder, _, base = name.rpartition("/")
    stem, _, ext = base.partition(".")
    return (f"{folder}/{stem}" if folder else stem), ext.lower()


def read_tar(path: str, rows_parquet: str | None = None, fields: tuple = ()) -> Iterator[dict | Skipped]:
    """The samples of one webdataset tar; `fields`: json fields carried as they are, besides LAION's
    metadata (the MLPerf COCO set's `timestep`: convert/mlperf_flux_images.py)."""
    shard = Path(path).stem
    if rows_parquet is not None:
        yield from _failed_rows(rows_parquet)
    key, group = None, {}
    try:
        # members are read into memory one by one, never extracted; "r" (random access, any
        # compression) reads an uncompressed tar about 1.4x faster than stream mode "r|"
        with tarfile.open(path, "r") as tar:
            for member in tar:
                if member.isdir():
                    continue
                if unsafe_path(member.name):
                    yield Skipped(member.name, "unsafe_path")
                    continue
                if not member.isfile():
                    yield Skipped(member.name, "not_a_file")
                    continue
                member_key, ext = split_name(member.name)
                if member_key != key:
                    if group:
                        yield _sample(key, group, fields)
                    key, group = member_key, {}
                if member.size > MAX_FILE_BYTES:
                    group[ext] = TOO_LARGE
                else:
                    group[ext] = tar.extractfile(member).read()
    except (tarfile.TarError, EOFError, OSError, zlib.error):
        # a cut-off or corrupt tar: the samples before the damage are kept, the one in progress is not
        yield Skipped(shard, "corrupt_tar")
        return
    if group:
        yield _sample(key, group, fields)


def _sample(key: str, group: dict, fields: tuple = ()) -> dict | Skipped:
    if "json" not in group:
        return Skipped(key, "missing_json")
    try:
        meta = json.loads(group["json"]) if group["json"] is not TOO_LARGE else None
    except (ValueError, UnicodeDecodeError):
        meta = None
    if not isinstance(meta, dict):
        return Skipped(key, "bad_json")
    image = next((group[ext] for ext in IMAGE_EXTENSIONS if ext in group), None)
    if image is TOO_LARGE:
        return Skipped(key, "file_too_large")
    # img2dataset writes a missing caption as the text "nan" or "" in .txt, but keeps null in the json
    caption = meta["caption"] if "caption" in meta else group.get("txt")
    carried = {name: meta.get(name) for name in fields}
    return {**pick_metadata(meta), **carried, "key": key, "image": image, "caption": caption}


def _failed_rows(path: str) -> Iterator[Skipped]:
    """Failed downloads listed in the shard's metadata parquet, so the report counts them too."""
    try:
        table = pq.read_table(path, columns=["key", "status"])
    except (pa.ArrowException, OSError, KeyError):
        return
    for key, status in zip(table["key"].to_pylist(), table["status"].to_pylist()):
        if status != "success":
            yield Skipped(str(key), status if status in FAILURES else "img2dataset_failed")


def read_parquet(path: str) -> Iterator[dict | Skipped]:
    shard = Path(path).stem
    try:
        handle = pq.ParquetFile(path)
        column = next(c for c in IMAGE_EXTENSIONS if c in handle.schema_arrow.names)
        for batch in handle.iter_batches(batch_size=256):
            for row in batch.to_pylist():
                key = row.get("key")
                if row[column] is None and row.get("status") in FAILURES:
                    yield Skipped(str(key), row["status"])
                    continue
                caption = row["caption"] if "caption" in row else row.get("txt")
                yield {**pick_metadata(row), "key": key, "image": row[column], "caption": caption}
    except (pa.ArrowException, OSError, StopIteration):
        yield Skipped(shard, "corrupt_parquet")
