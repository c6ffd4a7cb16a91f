"""`laion` source: LAION-style metadata parquet(s) with URL + caption columns.

img2dataset (the `laion` extra) downloads the images into a staging folder as webdataset shards, then
the `img2dataset` source reads those. It runs in a subprocess because it replaces the SIGINT handler
with one that exits 0, starts its own process pools and prints to stdout; its log goes to
`<staging>/img2dataset.log`. Images are kept exactly as served (`disable_all_reencoding`), so every
check and repair happens in one place (convert.images). img2dataset's incremental mode skips shards
it finished before, so a rerun downloads only what is missing.
"""

import importlib.util
import json
import logging
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from common.atomic import atomic_write_bytes
from convert import img2dataset_src
from convert.common import ConvertError, Part
from convert.samples import METADATA_NAMES

log = logging.getLogger(__name__)

URL_NAMES = ("url",)
CAPTION_NAMES = ("text", "caption", "txt")


def metadata_files(src: str | Path) -> list[Path]:
    src = Path(src).expanduser()
    files = sorted(src.glob("*.parquet")) if src.is_dir() else [src]
    if not files or not all(f.is_file() and os.access(f, os.R_OK) for f in files):
        raise ConvertError(f"--src {src}: not a readable parquet file or folder of parquet files")
    return files


def find_column(names: list[str], wanted: str | None, candidates: tuple, what: str, where: Path) -> str:
    if wanted is not None:
        if wanted not in names:
            raise ConvertError(f"--src {where}: no column {wanted!r} (columns: {', '.join(names)})")
        return wanted
    lowered = {n.lower(): n for n in names}
    for name in candidates:
        if name in lowered:
            return lowered[name]
    option = "--url-col" if what == "URL" else "--caption-col"
    raise ConvertError(f"--src {where}: no {what} column among {', '.join(names)}; name it with {option}")


def parts(
    src: str | Path,
    staging: str | Path,
    url_col: str | None = None,
    caption_col: str | None = None,
    processes: int = 1,
    threads: int = 32,
    timeout: int = 10,
    retries: int = 0,
    shard_size: int = 10_000,
) -> list[Part]:
    files = metadata_files(src)
    try:
        names = pq.read_schema(files[0]).names
    except (pa.ArrowException, OSError) as err:
        raise ConvertError(f"--src {files[0]}: not a readable parquet file ({err})") from None
    url_col = find_column(names, url_col, URL_NAMES, "URL", files[0])
    caption_col = find_column(names, caption_col, CAPTION_NAMES, "caption", files[0])
    known = {alias for aliases in METADATA_NAMES.values() for alias in aliases}
    extra = [n for n in names if n.lower() in known and n not in (url_col, caption_col)]
    staging = Path(staging)
    _claim_staging(staging, {"src": str(Path(src).expanduser().resolve()), "url_col": url_col,
                             "caption_col": caption_col, "shard_size": shard_size})  # fmt: skip
    if finished_download(files, staging, shard_size):
        log.info("every shard of %s is already downloaded in %s", src, staging)
        return img2dataset_src.parts(staging, "webdataset")
    download(
        src=str(Path(src).expanduser().resolve()),
        output_folder=str(staging),
        url_col=url_col,
        caption_col=caption_col,
        save_additional_columns=extra or None,
        processes_count=processes,
        thread_count=threads,
        timeout=timeout,
        retries=retries,
        number_sample_per_shard=shard_size,
    )
    return img2dataset_src.parts(staging, "webdataset")


def _claim_staging(staging: Path, source: dict) -> None:
    """Keep only downloads of this `source` in `staging`: the default work dir is named after --out
    alone, and img2dataset's shard numbers and incremental mode would take another source's shards
    for this one's. Downloads that predate this record are kept, as before. (Not a .json: img2dataset
    reads every *.json there as a shard's.)"""
    stamp = staging / ".sd-convert-source"
    try:
        found = json.loads(stamp.read_text())
    except FileNotFoundError:
        found = None
    except (OSError, ValueError):
        found = {}
    if found is not None and found != source:
        log.warning("%s holds downloads of another source (%s); deleting them", staging, found.get("src"))
        shutil.rmtree(staging)
    if found != source:
        atomic_write_bytes(stamp, json.dumps(source).encode())


def finished_download(files: list[Path], staging: Path, shard_size: int) -> bool:
    """Whether img2dataset finished every shard it would make (a `_stats.json` each), so a rerun need
    not start it: its start-up alone (process pools importing OpenCV) takes seconds.

    img2dataset cuts each input file into ceil(rows / shard_size) shards, numbered on across files.
    """
    try:
        shards = sum(math.ceil(pq.ParquetFile(f).metadata.num_rows / shard_size) for f in files)
    except (pa.ArrowException, OSError):
        return False
    return all((staging / f"{i:05d}_stats.json").exists() for i in range(shards))


def download(src: str, output_folder: str, **options) -> None:
    """Run img2dataset.download(...) in a subprocess; raise ConvertError if it fails."""
    if importlib.util.find_spec("img2dataset") is None:
        raise ConvertError("the laion source needs img2dataset: pip install 'sd-recipes[laion]'")
    kwargs = dict(
        url_list=src,
        output_folder=output_folder,
        input_format="parquet",
        output_format="webdataset",
        resize_mode="no",
        disable_all_reencoding=True,  # keep the served bytes; convert.images judges and repairs
        enable_wandb=False,
        compute_hash=None,
        extract_exif=False,
        incremental_mode="incremental",
        **options,
    )
    Path(output_folder).mkdir(parents=True, exist_ok=True)
    log_path = Path(output_folder) / "img2dataset.log"
    code = "import json, sys; from img2dataset import download; download(**json.loads(sys.argv[1]))"
    env = {**os.environ, "NO_ALBUMENTATIONS_UPDATE": "1"}  # albumentations otherwise asks PyPI on import
    log.info("downloading %s with img2dataset into %s (log: %s)", src, output_folder, log_path)
    with open(log_path, "ab") as log_file:
        result = subprocess.run(
            [sys.executable, "-c", code, json.dumps(kwargs)],
            stdout=log_file,
            stderr=subprocess.STDOUT,
            env=env,
        )
    if result.returncode != 0:
        lines = log_path.read_text(errors="replace").strip().splitlines()
        raise ConvertError(
            f"img2dataset failed (exit {result.returncode}) downloading {src} into {output_folder}: "
            f"{lines[-1] if lines else 'no output'} (full log: {log_path})"
        )
