"""Types every converter module shares: what a source yields, what an input is, what a fatal error is."""

import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

# Columns every image-caption converter writes. `image` holds encoded image bytes: the original file's
# bytes unless the image had to be repaired or a resize was asked for; width/height describe those bytes,
# original_width/original_height the image before that resize (SDXL's micro-conditioning: convert/images.py).
BASE_COLUMNS = {
    "image": "bytes",
    "caption": "str",
    "width": "int32",
    "height": "int32",
    "original_width": "int32",
    "original_height": "int32",
    "key": "str",
}
# LAION metadata, written by the `laion` and `img2dataset` sources (NaN / "" where the input lacks it).
LAION_COLUMNS = {
    "url": "str",
    "similarity": "float64",
    "punsafe": "float64",
    "pwatermark": "float64",
    "aesthetic": "float64",
}

MAX_FILE_BYTES = 256 << 20  # larger files are skipped unread: no real training image is that big


@dataclass(frozen=True)
class Skipped:
    """What a sample iterator yields instead of a sample it could not use."""

    key: str
    reason: str


class ConvertError(Exception):
    """A problem that stops the whole run (bad --src, bad credentials, unreachable S3).

    The message is the one line the CLI prints, so it says what failed and where.
    """


@dataclass(frozen=True)
class Part:
    """One input (a tar, a parquet, a chunk of a folder) that becomes one MDS sub-dataset.

    `read(*args)` yields raw samples (see convert.samples.prepare) or Skipped. `read` is a module-level
    function and `args` plain data, so a Part can be sent to a worker process. `name` is stable across
    runs and safe as a folder name: it is where the sub-dataset and its completion marker live.
    """

    name: str
    read: Callable[..., Iterator]
    args: tuple = field(default=())
    size: int | None = None  # number of raw samples, when known up front (for the progress bar)

    def samples(self) -> Iterator:
        return self.read(*self.args)


def chunk_name(index: int) -> str:
    return f"part-{index:05d}"


def readable_folder(src: str | Path) -> Path:
    """`src` as a Path, checked now so that nothing is written for a bad --src."""
    src = Path(src).expanduser()
    if not src.is_dir() or not os.access(src, os.R_OK | os.X_OK):
        raise ConvertError(f"--src {src}: not a readable folder")
    return src


def unsafe_path(name: str) -> bool:
    """A member/file name from an input that tries to leave its folder (never used as a path).

    Plain string tests, not pathlib: this runs for every tar member."""
    return name.startswith(("/", "~")) or "\\" in name or ".." in name.split("/")
