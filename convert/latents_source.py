"""The inputs of an MDS image-caption set, for `sd-convert latents`: one Part per input the set was
converted from (read from its top-level index.json), yielding its rows bucket by bucket."""

import contextlib
import json
import tempfile
from collections.abc import Iterator
from pathlib import Path

from convert.common import ConvertError, Part
from convert.samples import bucket_label
from data.buckets import bucket_ratio


def source_parts(src: str | Path) -> tuple[list[Part], tuple[float, ...]]:
    """(one Part per input of the MDS set at `src`, the aspect-ratio buckets it is sorted into).

    Read from the top-level index.json, which names finished inputs only. Shard paths are
    `[<bucket>/]NAME/shard...` as convert.pipeline writes them (NAME is the input, over all its
    buckets), or `shard...` at the top of a set written in one piece: each such shard is an input.
    A Part yields (bucket, row) pairs, bucket by bucket."""
    root = Path(src).expanduser()
    if not (root / "index.json").is_file():
        raise ConvertError(f"--src {src}: no index.json, not an MDS dataset (convert the images first)")
    try:
        shards = json.loads((root / "index.json").read_text())["shards"]
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise ConvertError(f"--src {src}: unreadable index.json ({type(err).__name__}: {err})") from None
    inputs: dict[str, dict[str, list[dict]]] = {}  # name -> bucket -> shard entries, in index order
    for entry in shards:
        missing = {"image", "caption"} - set(entry.get("column_names", ()))
        if entry.get("format") != "mds" or missing:
            raise ConvertError(
                f"--src {src}: not an MDS image-caption set (no {sorted(missing)} columns); convert the "
                "images with one of the other sources first"
            )
        path = entry["raw_data"]["basename"].split("/")
        if len(path) == 1:
            bucket, name = "", path[0].removesuffix(".mds")
        elif len(path) == 2:
            bucket, name = "", path[0]
        elif len(path) == 3 and bucket_ratio(path[0]) is not None:
            bucket, name = path[0], path[1]
        else:
            raise ConvertError(
                f"--src {src}: shard {'/'.join(path)} is not laid out as sd-convert writes sets "
                "([<bucket>/]<input>/shard...)"
            )
        inputs.setdefault(name, {}).setdefault(bucket, []).append(entry)
    labels = sorted({bucket for by_bucket in inputs.values() for bucket in by_bucket})
    if not inputs:
        raise ConvertError(f"--src {src}: index.json names no shards")
    if "" in labels and len(labels) > 1:
        raise ConvertError(f"--src {src}: mixes bucketed ({labels[1]}/...) and unbucketed shards")
    ratios = tuple(sorted(bucket_ratio(label) for label in labels if label))
    for ratio, label in zip(ratios, sorted((label for label in labels if label), key=bucket_ratio)):
        if bucket_label(ratio) != label:  # the pipeline names (and clears) bucket folders by ratio
            raise ConvertError(f"--src {src}: bucket folder {label} is not named as sd-convert names them")
    parts = [
        Part(
            name,
            read_input,
            (str(root), tuple((bucket, tuple(entries)) for bucket, entries in sorted(by_bucket.items()))),
            sum(entry["samples"] for entries in by_bucket.values() for entry in entries),
        )
        for name, by_bucket in inputs.items()
    ]
    return parts, ratios


def source_columns(src: str | Path) -> set[str]:
    """Every column a shard of the MDS set at `src` holds (its index.json, checked by source_parts)."""
    shards = json.loads((Path(src).expanduser() / "index.json").read_text())["shards"]
    return {name for entry in shards for name in entry.get("column_names", ())}


def read_input(root: str, buckets: tuple[tuple[str, tuple[dict, ...]], ...]) -> Iterator[tuple[str, dict]]:
    for bucket, entries in buckets:
        for entry in entries:
            for row in shard_rows(root, entry):
                yield bucket, row


def shard_rows(root: str, entry: dict) -> Iterator[dict]:
    """The rows of one MDS shard (its index.json entry), decompressing it to a temporary file when
    only the compressed form is there."""
    from compat.streaming import decompress, reader_from_json

    with contextlib.ExitStack() as stack:
        dirname = root
        raw = entry["raw_data"]["basename"]
        if not Path(root, raw).is_file() and entry.get("zip_data"):
            dirname = stack.enter_context(tempfile.TemporaryDirectory(prefix="sd-convert-shard-"))
            data = Path(root, entry["zip_data"]["basename"]).read_bytes()
            Path(dirname, raw).parent.mkdir(parents=True, exist_ok=True)
            Path(dirname, raw).write_bytes(decompress(entry["compression"], data))
        reader = reader_from_json(dirname, None, entry)
        for index in range(entry["samples"]):
            yield reader[index]
