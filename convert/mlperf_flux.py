"""`mlperf-flux` source: the MLPerf Flux.1 reference's preprocessed sets, as MLCommons publishes them,
into the set `sd-convert latents --preset flux-schnell` writes.

What the reference publishes (mlcommons/training text_to_image README, "Preprocessing": the
flux-1-cc12m-preprocessed, flux-1-coco-preprocessed and flux-1-empty-encodings downloads; written by its
torchtitan 9603aa83 torchtitan/experiments/flux/scripts/preprocess_flux_dataset.py): a folder saved by
Hugging Face `datasets`' save_to_disk, i.e. Arrow IPC stream files `data-NNNNN-of-NNNNN.arrow`, one row
per sample: `__key__` (string), `t5_encodings`, `clip_encodings`, `mean`, `logvar` (each the bytes of
`np.save` of a uint16 array holding bf16 values: T5's (256, 4096) context, CLIP's pooled (768,), the
VAE posterior's (16, 32, 32) mean and log-variance) and `timestep` (int32: the COCO validation set's
fixed timestep index, t = i / 8, null in the training set); and a folder with `t5_empty.npy` and
`clip_empty.npy` (fp16), the empty caption's encodings.

What it writes: per row `key`, `caption` ("": the reference keeps no captions), `latents_{R}` (mean and
log-variance on channels, as data/latent_dataset.py reads them), `text_embeds` and
`pooled_text_embeds`, and for the validation set `eval_timestep`, which validation then uses instead of
its own content-hashed one (models/engine/eval_timesteps.py). The empty caption goes beside index.json as the
`latents` source writes it (convert/empty_caption.py). bf16 -> fp16 is exact for every value of
magnitude 2^-14 .. 65504 (fp16 keeps 10 mantissa bits to bf16's 7; below 2^-14 fp16 is subnormal and
keeps fewer); a row holding a value beyond fp16's range or a non-finite one is skipped
(`out_of_fp16_range`, `not_finite`), never written rounded to infinity.

One input per Arrow file, on convert.pipeline like every source (markers, restarts, --workers, S3).
"""

import hashlib
import io
import json
import logging
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import torch

from convert.common import ConvertError, Part, Skipped, readable_folder
from data.latent_dataset import EMPTY_CAPTION, EVAL_TIMESTEP, latents_column
from models.presets import vae_factor
from models.registry import PRESETS

TIMESTEP_COLUMN = EVAL_TIMESTEP  # read back by data/latent_dataset.py
REFERENCE_COLUMNS = ("__key__", "t5_encodings", "clip_encodings", "mean", "logvar")
FP16_MAX = 65504.0
log = logging.getLogger(__name__)
IMAGE_SET_HINT = (
    "the reference's image set (flux-1-cc12m-disk or flux-1-coco), not its preprocessed one: "
    "`sd-convert mlperf-flux-images` converts it, then `sd-convert latents --preset flux-schnell`"
)
EMPTY_FILES = {"text_embeds": "t5_empty.npy", "pooled_text_embeds": "clip_empty.npy"}


@dataclass(frozen=True)
class MlperfOptions:
    """What identifies the conversion (convert.pipeline's Options protocol)."""

    preset: str
    resolution: int
    buckets: tuple = ()
    compression: str | None = None
    shard_size_limit: int = 1 << 26

    def digest(self, columns: dict) -> str:
        blob = json.dumps([self.preset, self.resolution, self.compression, self.shard_size_limit, columns])
        return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _reads_the_reference(preset: str) -> bool:
    """Whether `preset`'s precomputed set is the reference's: a T5 context from its second text encoder
    and one pooled vector (the flux presets)."""
    from convert.latents import preset_columns

    spec = PRESETS[preset]
    stored = set(preset_columns(preset, [1])) - {"caption", "key", latents_column(1)}
    return "d_model" in spec.get("text_encoder_2", {}) and stored == {"text_embeds", "pooled_text_embeds"}


def shapes(preset: str) -> dict[str, tuple[int, ...]]:
    """Each reference column's per-sample shape for `preset` (latents: per side, any side)."""
    spec = PRESETS[preset]
    return {
        "mean": (spec["vae"]["latent_channels"],),
        "t5_encodings": (spec["t5_tokens"], spec["text_encoder_2"]["d_model"]),
        "clip_encodings": (spec["text_encoder"]["hidden_size"],),
    }


def arrow_files(src: str | Path) -> list[Path]:
    folder = readable_folder(src)
    files = sorted(folder.glob("data-*.arrow"))
    if not files and any(folder.glob("*.tar")):
        raise ConvertError(f"--src {src}: {IMAGE_SET_HINT}")
    if not files:
        raise ConvertError(
            f"--src {src}: no data-*.arrow files; give the folder of the reference's preprocessed set "
            "(flux-1-cc12m-preprocessed or flux-1-coco-preprocessed, as datasets' save_to_disk writes it)"
        )
    return files


def batches(path: Path) -> Iterator[pa.RecordBatch]:
    try:
        with pa.memory_map(str(path)) as source:
            yield from pa.ipc.open_stream(source)
    except (pa.ArrowInvalid, OSError) as err:
        raise ConvertError(f"{path}: not an Arrow IPC stream file ({err})") from None


def survey(src: str | Path, preset: str) -> tuple[list[Path], int, bool]:
    """(the Arrow files, the resolution, whether rows carry a timestep) from the first row, with the
    columns and shapes checked against `preset`."""
    files = arrow_files(src)
    path, first = next(((f, b) for f in files for b in batches(f) if b.num_rows), (files[0], None))
    if first is None:
        raise ConvertError(f"--src {src}: its Arrow files hold no rows")
    missing = [c for c in REFERENCE_COLUMNS if c not in first.schema.names]
    if missing and {"png", "jpg"} & set(first.schema.names):
        raise ConvertError(f"--src {src}: {IMAGE_SET_HINT}")
    if missing:
        raise ConvertError(f"{path}: no column {missing} (columns: {first.schema.names})")
    row = {name: first.column(name)[0].as_py() for name in first.schema.names}
    try:
        values = {name: decode(row[name]) for name in ("mean", "t5_encodings", "clip_encodings")}
    except (ValueError, TypeError, OSError) as err:
        raise ConvertError(f"{path}: the first row's arrays are not bf16 .npy bytes ({err})") from None
    for name, shape in shapes(preset).items():
        got = values[name].shape
        if (got[: len(shape)] if name == "mean" else got) != shape:
            wanted = f"({shape[0]}, side, side)" if name == "mean" else str(shape)
            raise ConvertError(f"{path}: {name} is {tuple(got)} per sample; preset {preset} reads {wanted}")
    mean = values["mean"]
    if mean.ndim != 3 or mean.shape[1] != mean.shape[2]:
        raise ConvertError(f"{path}: mean is {tuple(mean.shape)} per sample, not (C, side, side)")
    return files, mean.shape[-1] * vae_factor(preset), row.get("timestep") is not None


def decode(data: bytes) -> torch.Tensor:
    """A reference column's value: np.save bytes of uint16 holding bf16, as a bf16 tensor."""
    array = np.load(io.BytesIO(data), allow_pickle=False)
    if array.dtype != np.uint16:
        raise ValueError(f"an array of {array.dtype}, not bf16 held as uint16")
    return torch.from_numpy(array.copy()).view(torch.bfloat16)


def _half(value: torch.Tensor) -> np.ndarray | str:
    """`value` as fp16 numpy, or the reason it cannot be (exactly) one."""
    if not torch.isfinite(value).all():
        return "not_finite"
    if value.abs().max().item() > FP16_MAX:
        return "out_of_fp16_range"
    return value.to(torch.float16).numpy()


def parts(files: list[Path], resolution: int, timesteps: bool, preset: str) -> list[Part]:
    args = (resolution, timesteps, preset)
    return [Part(path.stem, read_rows, (str(path), *args), row_count(path)) for path in files]


def row_count(path: Path) -> int:
    """Rows of an Arrow stream file, from its batch headers (memory-mapped: the bodies are not read)."""
    return sum(batch.num_rows for batch in batches(path))


def read_rows(path: str, resolution: int, timesteps: bool, preset: str) -> Iterator[dict | Skipped]:
    """The rows of one Arrow file, one at a time: each value is copied out of the memory-mapped file on
    its own (a record batch of 1,000 rows holds ~2 GB of T5 contexts)."""
    column = latents_column(resolution)
    side = resolution // vae_factor(preset)
    expected = shapes(preset)
    wanted = {
        column: (2 * expected["mean"][0], side, side),
        "text_embeds": expected["t5_encodings"],
        "pooled_text_embeds": expected["clip_encodings"],
    }
    for batch in batches(Path(path)):
        names = batch.schema.names
        for i in range(batch.num_rows):
            key = str(batch.column("__key__")[i].as_py())
            try:
                mean, logvar, t5, clip = (
                    decode(batch.column(name)[i].as_py())
                    for name in ("mean", "logvar", "t5_encodings", "clip_encodings")
                )
                out = {column: torch.cat([mean, logvar]), "text_embeds": t5, "pooled_text_embeds": clip}
            except (ValueError, TypeError, OSError, RuntimeError) as err:
                log.debug("%s: row %s unreadable: %s", path, key, err)
                yield Skipped(key, "unreadable")
                continue
            if any(tuple(value.shape) != wanted[name] for name, value in out.items()):
                yield Skipped(key, "shape")
                continue
            halves = {name: _half(value) for name, value in out.items()}
            reasons = [h for h in halves.values() if isinstance(h, str)]
            if reasons:
                yield Skipped(key, reasons[0])
                continue
            row = {"key": key, "caption": "", **halves}
            if timesteps:
                step = batch.column("timestep")[i].as_py() if "timestep" in names else None
                if not isinstance(step, int):
                    yield Skipped(key, "missing_timestep")
                    continue
                row[TIMESTEP_COLUMN] = step
            yield row


@dataclass(frozen=True)
class WriteRows:
    """convert.pipeline's `write_rows`: the rows as they come, the skipped counted by reason; before
    an input's first row, the empty caption's file when given and the output lacks this conversion's
    (as the latents source writes it: convert/empty_caption.py)."""

    empty: bytes | None = None

    def __call__(self, part: Part, job, writer, progress=None) -> tuple[Counter, Counter]:
        write_empty(job.store, self.empty, job.digest)
        return write_rows(part, writer, progress)


def write_empty(store, empty: bytes | None, digest: str) -> None:
    from convert.empty_caption import held_digest

    if empty is not None and held_digest(store) != digest:
        store.write_bytes(EMPTY_CAPTION, empty)


def write_rows(part: Part, writer, progress=None) -> tuple[Counter, Counter]:
    skipped, pending = Counter(), 0
    for row in part.samples():
        if isinstance(row, Skipped):
            skipped[row.reason] += 1
        else:
            writer.write(row, "")  # no buckets: one square resolution
        pending += 1
        if progress is not None and pending == 64:
            progress(pending)
            pending = 0
    if progress is not None and pending:
        progress(pending)
    return skipped, Counter()


def empty_caption_bytes(folder: str | Path, preset: str, digest: str) -> bytes:
    """The EMPTY_CAPTION file from the reference's t5_empty.npy and clip_empty.npy (fp16), one sample."""
    from safetensors.torch import save

    expected = shapes(preset)
    tensors = {}
    for name, file in EMPTY_FILES.items():
        path = Path(folder).expanduser() / file
        try:
            array = np.load(path, allow_pickle=False)
        except (OSError, ValueError) as err:
            raise ConvertError(f"--empty-encodings {folder}: cannot read {file} ({err})") from None
        shape = expected["t5_encodings" if name == "text_embeds" else "clip_encodings"]
        value = torch.from_numpy(array).float().reshape(-1, *shape) if array.size else None
        if value is None or value.shape[0] != 1:
            raise ConvertError(f"{path}: {array.shape}, not one sample of {shape}")
        tensors[name] = value.contiguous()
    return save(tensors, metadata={"caption": "", "options": digest})


def convert_mlperf_flux(
    src: str,
    out: str,
    empty_encodings: str | None = None,
    preset: str = "flux-schnell",
    *,
    workers: int = 1,
    work_dir=None,
    progress: bool = True,
    overwrite: bool = False,
    compression: str | None = None,
    shard_size_limit: int = 1 << 26,
) -> dict:
    """Convert the reference's preprocessed set at `src` (and its empty encodings) into `out`; returns
    the run's report (convert.report)."""
    from convert.latents import preset_columns
    from convert.pipeline import convert
    from convert.storage import open_store

    fitting = [name for name in PRESETS if _reads_the_reference(name)]
    if preset not in fitting:
        raise ConvertError(f"--preset {preset}: a preset that reads what the set holds: {', '.join(fitting)}")
    files, resolution, timesteps = survey(src, preset)
    columns = preset_columns(preset, [resolution])
    if timesteps:
        columns[TIMESTEP_COLUMN] = "int32"
    options = MlperfOptions(preset, resolution, (), compression, shard_size_limit)
    empty = (
        None
        if empty_encodings is None
        else empty_caption_bytes(empty_encodings, preset, options.digest(columns))
    )
    inputs = parts(files, resolution, timesteps, preset)
    report = convert(
        inputs, out, options, columns, source="mlperf-flux", src=str(src),
        workers=workers, work_dir=work_dir, progress=progress, overwrite=overwrite,
        write_rows=WriteRows(empty),
    )  # fmt: skip
    write_empty(open_store(out), empty, options.digest(columns))  # inputs all done before: not yet there
    return report
