"""Turn one raw sample from a source into a row to write, or a Skipped with the reason.

A raw sample is a dict with `key`, `image` (encoded bytes, or None when the input had none),
`caption` (anything: str, bytes, None, NaN) and whatever metadata the input had under the output
column names (`url`, `similarity`, `punsafe`, `pwatermark`, `aesthetic`, `captions`, ...). Sources
stay dumb readers; every judgement about captions, metadata and images is made here, the same way
for every source.
"""

import dataclasses
import hashlib
import json
import math
import operator
from dataclasses import dataclass, field

from convert.common import Skipped
from convert.images import ImageOptions, SkipSample, prepare_image_sized

# (metadata column, option, keep if op(value, limit)). A sample whose value is missing is skipped when
# the filter is on: an unknown NSFW score is not a passing one.
FILTERS = (
    ("aesthetic", "min_aesthetic", operator.ge),
    ("punsafe", "max_punsafe", operator.le),
    ("pwatermark", "max_watermark", operator.le),
    ("similarity", "min_similarity", operator.ge),
)


@dataclass(frozen=True)
class Options:
    """Everything that changes what gets written. Stored (hashed) in each input's completion marker,
    so a rerun with different options cannot silently mix two kinds of output."""

    image: ImageOptions = field(default_factory=ImageOptions)
    min_aesthetic: float | None = None
    max_punsafe: float | None = None
    max_watermark: float | None = None
    min_similarity: float | None = None
    keep_empty_captions: bool = False
    buckets: tuple[float, ...] = ()  # aspect ratios (width / height); empty: no bucketing
    compression: str | None = None  # images are compressed already: zstd saves 0-2% at 2x the write time
    shard_size_limit: int = 1 << 26

    def digest(self, columns: dict) -> str:
        blob = json.dumps([dataclasses.asdict(self), columns], sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]


def clean_caption(value, keep_empty: bool = False) -> str | Skipped:
    """The caption as stripped text, or a Skipped (with an empty key) saying why it is unusable.

    Long captions are kept whole: truncation to the text encoder's length happens at tokenization.
    """
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return Skipped("", "missing_caption")
    if isinstance(value, bytes | bytearray | memoryview):
        try:
            value = bytes(value).decode("utf-8")
        except UnicodeDecodeError:
            return Skipped("", "caption_not_utf8")
    elif not isinstance(value, str):
        value = str(value)
    try:
        value.encode("utf-8")  # lone surrogates (from surrogateescape or JSON "\ud800") cannot be stored
    except UnicodeEncodeError:
        return Skipped("", "caption_not_utf8")
    text = value.lstrip("\ufeff").strip()
    if not text and not keep_empty:
        return Skipped("", "empty_caption")
    return text


def to_float(value) -> float:
    """A metadata number; NaN when missing or not a number (metadata comes from untrusted files)."""
    if value is None or isinstance(value, bool):
        return math.nan
    try:
        return float(value)
    except (TypeError, ValueError):
        return math.nan


def to_text(value) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return ""
    text = value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        text = text.encode("utf-8", "replace").decode("utf-8")
    return text


def to_int(value) -> int:
    number = to_float(value)
    return int(number) if math.isfinite(number) else -1


COERCE = {"str": to_text, "float64": to_float, "float32": to_float, "int32": to_int, "int64": to_int}


# Metadata columns and the names inputs use for them (compared case-insensitively): LAION releases
# spell them `AESTHETIC_SCORE`, `similarity`, ...; img2dataset keeps whatever it was given.
METADATA_NAMES = {
    "url": ("url",),
    "similarity": ("similarity",),
    "punsafe": ("punsafe",),
    "pwatermark": ("pwatermark",),
    "aesthetic": ("aesthetic", "aesthetic_score"),
}


def pick_metadata(record: dict) -> dict:
    """The LAION metadata present in a json object or parquet row, under the output column names."""
    lowered = {str(k).lower(): v for k, v in record.items()}
    found = {}
    for column, names in METADATA_NAMES.items():
        for name in names:
            if name in lowered:
                found[column] = lowered[name]
                break
    return found


def filter_reason(raw: dict, opts: Options) -> str | None:
    for column, option, keep in FILTERS:
        limit = getattr(opts, option)
        if limit is None:
            continue
        value = to_float(raw.get(column))
        if math.isnan(value):
            return f"missing_{column}"
        if not keep(value, limit):
            return f"filtered_{column}"
    return None


def prepare(raw: dict, opts: Options, columns: dict) -> tuple[dict, tuple[str, ...]] | Skipped:
    """(row with exactly `columns`, repairs made) or Skipped. Cheap checks first, the image last."""
    key = to_text(raw.get("key"))
    caption = clean_caption(raw.get("caption"), opts.keep_empty_captions)
    if isinstance(caption, Skipped):
        return Skipped(key, caption.reason)
    reason = filter_reason(raw, opts)
    if reason is not None:
        return Skipped(key, reason)
    data = raw.get("image")
    if data is None:
        return Skipped(key, "missing_image")
    try:
        image = prepare_image_sized(data, opts.image)
    except SkipSample as skip:
        return Skipped(key, skip.reason)
    row = {
        "image": image.data,
        "caption": caption,
        "width": image.width,
        "height": image.height,
        "original_width": image.original_width,
        "original_height": image.original_height,
        "key": key,
    }
    for column, kind in columns.items():
        if column not in row:
            row[column] = COERCE[kind](raw.get(column))
    return row, image.repairs


def bucket_name(width: int, height: int, buckets: tuple[float, ...]) -> str:
    """The sub-dataset for this aspect ratio: the nearest bucket on a log scale ("" without buckets)."""
    if not buckets:
        return ""
    ratio = math.log(width / height)
    return bucket_label(min(buckets, key=lambda b: abs(math.log(b) - ratio)))


def bucket_label(ratio: float) -> str:
    return f"ar{ratio:g}"
