"""`mlperf-flux-images` source: the MLPerf Flux.1 reference's image sets, as MLCommons publishes them,
into an image-caption set (then `sd-convert latents --preset flux-schnell`, as for any image set).

What the reference publishes (mlcommons/training text_to_image README, "Steps to download and verify
data"; written by its torchtitan 9603aa83 torchtitan/experiments/flux/scripts/):
- flux-1-cc12m-disk, the cleaned 10% of CC12M (1,099,776 samples): clean_cc12m.py's datasets
  `save_to_disk` folder, Arrow IPC stream files `data-NNNNN-of-NNNNN.arrow` whose rows keep the
  webdataset's `__key__`, `jpg` (the original) and `txt`, plus `png`: the image resized with bicubic
  so its shorter side is 256, then centre-cropped to 256x256. Images are datasets' struct
  {bytes, path}. The reference trains on `png` where there is one (flux_dataset.py
  _cc12m_wds_data_processor), and so do we: no `png` column is not the cleaned set.
- flux-1-coco, the validation set (29,696 COCO-2014 val images, one caption each, seed 2023):
  coco_to_webdataset.py's tars `shard_NNNNN.tar` holding `{image_id:012d}.png` (squashed to 256x256
  with bicubic, no crop), `.txt` (the caption) and `.json` ({"id", "caption", "filename",
  "timestep"}: row i of the subset sorted by annotation id has timestep i % 8, 3,712 per level).
  val2014_30k.tsv lists the same subset; nothing here needs it.

What it writes: the usual image columns (convert/common.py BASE_COLUMNS) with each image's bytes as
the reference made them: a 256x256 PNG needs no resize, so the pipeline keeps the bytes untouched
(convert/images.py), unless --resize-max or --center-crop ask otherwise. The COCO set adds
`eval_timestep` (int32), which `sd-convert latents` carries into the latent set and validation then
uses instead of its content-hashed timestep (models/engine/eval_timesteps.py), on the image path too. A
COCO sample whose json holds no timestep in 0..7 is skipped (`bad_timestep`), never given another.

One input per Arrow file or tar, on convert.pipeline like every source (markers, restarts, --workers, S3).
"""

from collections.abc import Iterator
from pathlib import Path

from convert import img2dataset_src
from convert.common import BASE_COLUMNS, ConvertError, Part, Skipped, readable_folder
from convert.mlperf_flux import REFERENCE_COLUMNS, batches, row_count
from data.latent_dataset import EVAL_TIMESTEP
from models.engine.eval_timesteps import STORED_LEVELS

TRAIN_COLUMNS = ("__key__", "txt", "png")
PREPROCESSED_HINT = (
    "the reference's preprocessed set (flux-1-*-preprocessed), not its image set: "
    "`sd-convert mlperf-flux` converts it"
)


def layout(src: str | Path) -> str:
    """ "coco" (webdataset tars) or "cc12m" (Arrow files with a png column), checked on the first file."""
    folder = readable_folder(src)
    if any(folder.glob("*.tar")):
        return "coco"
    files = sorted(folder.glob("data-*.arrow"))
    if not files:
        raise ConvertError(
            f"--src {src}: neither the reference's CC12M image set (data-*.arrow, as clean_cc12m.py "
            "saves it) nor its COCO set (shard_*.tar, as coco_to_webdataset.py writes them)"
        )
    names = next((b.schema.names for f in files for b in batches(f)), [])
    if set(REFERENCE_COLUMNS) <= set(names):
        raise ConvertError(f"--src {src}: {PREPROCESSED_HINT}")
    missing = [c for c in TRAIN_COLUMNS if c not in names]
    if missing:
        raise ConvertError(
            f"{files[0]}: no column {missing} (columns: {names}); the cleaned CC12M set's rows hold "
            "__key__, txt and the 256 px png clean_cc12m.py made"
        )
    return "cc12m"


def columns(src: str | Path) -> dict[str, str]:
    """The written columns: the image columns, and the COCO set's timestep."""
    extra = {EVAL_TIMESTEP: "int32"} if layout(src) == "coco" else {}
    return {**BASE_COLUMNS, **extra}


def parts(src: str | Path) -> list[Part]:
    folder = readable_folder(src)
    if layout(src) == "coco":
        return [Part(tar.stem, read_coco_tar, (str(tar),)) for tar in sorted(folder.glob("*.tar"))]
    files = sorted(folder.glob("data-*.arrow"))
    return [Part(path.stem, read_cc12m, (str(path),), row_count(path)) for path in files]


def read_coco_tar(path: str) -> Iterator[dict | Skipped]:
    """img2dataset's tar reader (streamed, hostile member names skipped) with the json's timestep."""
    for sample in img2dataset_src.read_tar(path, fields=("timestep",)):
        if isinstance(sample, Skipped):
            yield sample
            continue
        step = sample.pop("timestep")
        if type(step) is not int or not 0 <= step < STORED_LEVELS:
            yield Skipped(sample["key"], "bad_timestep")
            continue
        yield {**sample, EVAL_TIMESTEP: step}


def read_cc12m(path: str) -> Iterator[dict | Skipped]:
    """The rows of one Arrow file: `png`'s bytes, `txt`, `__key__`, a record batch at a time (the
    files also hold the originals in `jpg`, which are never decoded here)."""
    for batch in batches(Path(path)):
        keys = batch.column("__key__").to_pylist()
        captions = batch.column("txt").to_pylist()
        images = batch.column("png")
        for i, key in enumerate(keys):
            image = images[i].as_py()  # datasets' Image feature: {"bytes": ..., "path": ...}
            data = image.get("bytes") if isinstance(image, dict) else None
            if data is None:
                yield Skipped(str(key), "missing_image")
                continue
            yield {"key": str(key), "image": data, "caption": captions[i]}
