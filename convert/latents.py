"""`latents` source: run the frozen VAE and text encoder over an MDS image-caption set once.

Writes, per sample, `latents_{R}` for each resolution R (the VAE posterior's mean and logvar,
unscaled, fp16: the model samples and scales them) and `text_embeds` (fp16), plus caption and key.
Training on these skips the VAE and text encoder, about 1.4x faster for SD2 (mosaicml/diffusion).
An SDXL preset (models/families/sdxl/model.py) writes what its UNet reads besides, as training on the
images computes it (data/image_caption.py): `text_embeds` (77, 2048) from both
encoders, `pooled_text_embeds` (1280,) fp16, `original_size` (height, width) and per resolution
`crop_top_left_{R}` (top, left) int64 (data/latent_dataset.py reads them back). An mmdit preset
(models/families/mmdit/model.py) writes what RectifiedFlowTransformer reads instead of token ids, through its
own `encode_clip` and `encode_t5`: `text_embeds` (77, 768 + 1280 for sd3-medium), both CLIPs' context
unpadded, `pooled_text_embeds` (2048,) both pooled vectors, and, when the `--pretrained` folder has a
T5 (`text_encoder_3/` and `tokenizer_3/`), `text_embeds_3` (t5_tokens, 4096) fp16; its `latents_{R}`
are the 16-channel VAE's moments, unscaled and unshifted (the model applies latent_shift and
latent_scale). A source's `eval_timestep` (a validation set's fixed timestep per sample: MLPerf's
COCO, convert/mlperf_flux_images.py) is carried over as it is. Once per output, the empty caption's
encodings go beside index.json, for caption dropout without the text encoders
(convert/empty_caption.py).

Runs on convert.pipeline like the image converters: one input per input of the source, read from
its index.json (`<src>/[<bucket>/]NAME/`, or each shard of a flat set), written to the same place
under --out, with completion markers, restarts and a merged index.json, locally or to S3; in
`--workers N` processes and/or the ranks of `composer -n N`, each on its own GPU when there are any.
A bucketed source (`sd-convert --buckets`) keeps its buckets, each encoded at its own size
(data/buckets.py: about R^2 pixels, multiples of the VAE x denoiser downsampling), so a bucket's
`latents_{R}` is (8, h/f, w/f) for its (h, w); without buckets, R x R as training crops it.
"""

import dataclasses
import hashlib
import json
import logging
import os
from collections import Counter
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image

import models.registry as families
from convert import empty_caption
from convert.common import Part, Skipped
from convert.encoders import (
    Encoders,
    RecipeModel,
    check_encoder_flags,
    load_encoders,
    recipe_encoders,
    recipe_settings,
)
from convert.latents_source import source_columns, source_parts
from data.buckets import bucket_crop, bucket_ratio, bucket_size, cover_crop
from data.image_caption import original_size
from data.latent_dataset import EVAL_TIMESTEP, crop_column, latents_column
from data.transforms import Crop
from models.engine.pixels import to_float
from models.presets import bundled_t5, size_multiple
from models.registry import PRESETS

log = logging.getLogger(__name__)


def columns(
    resolutions: list[int], sdxl: bool = False, *, pooled: bool = False, t5: bool = False
) -> dict[str, str]:
    """The written columns: `sdxl` adds SDXL's pooled vector and micro-conditioning, `pooled` the
    pooled vector alone (an mmdit preset's), `t5` T5's context `text_embeds_3`."""
    cols = {"caption": "str", "key": "str", "text_embeds": "ndarray:float16"}
    cols.update({latents_column(r): "ndarray:float16" for r in resolutions})
    if sdxl or pooled:
        cols["pooled_text_embeds"] = "ndarray:float16"
    if sdxl:
        cols["original_size"] = "ndarray:int64"
        cols.update({crop_column(r): "ndarray:int64" for r in resolutions})
    if t5:
        cols["text_embeds_3"] = "ndarray:float16"
    return cols


def preset_columns(preset: str, resolutions: list[int], t5: bool = False) -> dict[str, str]:
    """The columns `preset`'s family stores (`t5`: an mmdit preset's T5 context too)."""
    family = families.of(preset)
    if t5 and not family.reads_t5:
        raise ValueError(f"preset {preset!r} (family {family.name}) reads no T5 context")
    return columns(resolutions, family.micro_conditioning, pooled=family.conditioner.pooled, t5=t5)


def pixel_sizes(bucket: str, resolutions, preset: str) -> dict[int, tuple[int, int]]:
    """(height, width) per resolution: the bucket's size (data/buckets.py, multiples of the preset's
    `size_multiple`), R x R without buckets."""
    if not bucket:
        return {r: (r, r) for r in resolutions}
    return {r: bucket_size(bucket_ratio(bucket), r, size_multiple(preset)) for r in resolutions}


def _pixels(image_bytes: bytes, height: int, width: int | None = None) -> torch.Tensor:
    """Encoded image -> (3, height, width) in [-1, 1], as training crops it (square: width=None)."""
    return cover_crop(image_bytes, height, height if width is None else width)


def _prepare(row: dict, sizes: dict[int, tuple[int, int]]) -> dict[int, Crop] | str:
    try:  # `_pixels`' pixels, and where they were cropped
        return {r: bucket_crop(row["image"], *size) for r, size in sizes.items()}
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError):
        return "corrupt_image"


def _text_columns(model, captions: list[str], device) -> dict[str, np.ndarray]:
    """The text encoders' outputs as stored: the family conditioner's `encode` (models/engine/conditioners.py)
    of the captions' token ids, the model's own call."""
    conditioner = model.conditioner
    ids = {name: value.to(device) for name, value in conditioner.ids(model, captions).items()}
    return {name: value.half().cpu().numpy() for name, value in conditioner.encode(model, ids).items()}


@torch.no_grad()
def _encode(model, rows: list[dict], crops: list[dict], resolutions, device) -> list[dict]:
    captions = [row["caption"] for row in rows]
    text = _text_columns(model, captions, device)
    latents, dtype = {}, model.vae.dtype  # fp32, or bf16 (--precision bf16: Flux's, as its reference)
    for r in resolutions:
        batch = torch.stack([c[r].pixels for c in crops]).to(device, non_blocking=True)
        latents[r] = model.vae_moments(to_float(batch).to(dtype)).half().cpu().numpy()
    micro = getattr(model, "micro_conditioning", False)
    samples = []
    for j, row in enumerate(rows):
        sample = {"caption": captions[j], "key": row["key"], **{k: v[j] for k, v in text.items()}}
        sample.update({latents_column(r): np.ascontiguousarray(latents[r][j]) for r in resolutions})
        if EVAL_TIMESTEP in row:  # a validation set's fixed timestep (MLPerf's COCO) travels with it
            sample[EVAL_TIMESTEP] = int(row[EVAL_TIMESTEP])
        if micro:  # what the image path hands over for an unflipped sample (data/image_caption.py)
            stored = crops[j][resolutions[0]].size
            sample["original_size"] = np.array(original_size(row, stored), dtype=np.int64)
            for r in resolutions:
                sample[crop_column(r)] = np.array(crops[j][r].top_left, dtype=np.int64)
        samples.append(sample)
    return samples


def encode_rows(
    rows: Iterable[tuple[str, dict]],
    model,
    resolutions,
    preset: str,
    batch_size: int = 16,
    device="cpu",
    decode_threads: int = 1,
) -> Iterator[tuple[str, dict] | Skipped]:
    """(bucket, sample with latents) for each (bucket, source row), in order, batch by batch within a
    bucket; a Skipped for a row whose image does not decode."""
    sizes: dict[str, dict] = {}
    pool = ThreadPoolExecutor(decode_threads) if decode_threads > 1 else None
    mapper = pool.map if pool is not None else map

    def flush(bucket: str, batch: list[dict]) -> Iterator[tuple[str, dict] | Skipped]:
        prepared = list(mapper(lambda row: _prepare(row, sizes[bucket]), batch))
        keep = [(row, p) for row, p in zip(batch, prepared) if not isinstance(p, str)]
        for row, p in zip(batch, prepared):
            if isinstance(p, str):
                yield Skipped(row["key"], p)
        if keep:
            for sample in _encode(model, [r for r, _ in keep], [p for _, p in keep], resolutions, device):
                yield bucket, sample

    try:
        batch, current = [], None
        for index, (bucket, row) in enumerate(rows):
            if batch and (bucket != current or len(batch) == batch_size):
                yield from flush(current, batch)
                batch = []
            if bucket not in sizes:
                sizes[bucket] = pixel_sizes(bucket, resolutions, preset)
            current = bucket
            batch.append({**row, "key": str(row.get("key", index))})
        if batch:
            yield from flush(current, batch)
    finally:
        if pool is not None:
            pool.shutdown()


def iter_samples(
    src: str, model, resolutions: list[int], batch_size: int = 16, device="cpu", preset: str = "sd2-base"
) -> Iterator[dict]:
    """Every sample of the MDS set `src` with its latents, input by input (index order for a set
    without buckets). `model`, a model or `load_encoders`' Encoders, has `vae_moments`, a `conditioner`
    and its parts, on `device`; `preset` gives the bucket sizes' multiple."""
    parts, _ = source_parts(src)
    for part in parts:
        for result in encode_rows(part.samples(), model, resolutions, preset, batch_size, device):
            if not isinstance(result, Skipped):
                yield result[1]


# --- running as pipeline inputs ------------------------------------------------------------------


@dataclass(frozen=True)
class LatentsOptions:
    """Everything that changes what gets written (hashed into the completion markers). The batch
    size is not: it changes nothing but the speed."""

    resolutions: tuple[int, ...]
    preset: str
    pretrained: str | None = None
    buckets: tuple[float, ...] = ()  # the source's, kept
    compression: str | None = None
    shard_size_limit: int = 1 << 26
    recipe: RecipeModel | None = None  # --recipe: the seed and model section the encoders come from
    precision: str = "fp32"  # the encoders' weights and compute: fp32, or bf16 (PRECISIONS)

    def digest(self, columns: dict) -> str:
        options = dataclasses.asdict(self)
        if options["recipe"] is None:  # so outputs written before --recipe existed keep their digest
            del options["recipe"]
        if options["precision"] == "fp32":  # and those written before --precision
            del options["precision"]
        blob = json.dumps([options, columns], sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]


# --precision: the encoders' dtype. bf16 is the MLPerf Flux.1 reference's (its preprocessing loads the
# VAE, T5 and CLIP in bf16: torchtitan 9603aa83 train.py, scripts/preprocess_flux_dataset.py), so the
# flux presets default to it; the stored columns stay fp16, which holds bf16 values exactly in its range.
PRECISIONS = {"fp32": torch.float32, "bf16": torch.bfloat16}


def default_precision(preset: str) -> str:
    """The family's (models/registry.py `encoder_precision`): bf16 for the flux presets."""
    return families.of(preset).encoder_precision if preset in PRESETS else "fp32"


def _held_precision(out: str, src: str, overwrite: bool) -> str | None:
    """The precision of the latents conversion of `src` that `out` holds, which a rerun without
    --precision continues: its recorded one, or fp32 for one recorded before --precision existed."""
    from convert.identity import RECORD, where
    from convert.storage import open_store

    held = None if overwrite else open_store(out).read_json(RECORD)
    if not held or held.get("source") != "latents" or held.get("src") != where(src):
        return None
    precision = (held.get("options") or {}).get("precision", "fp32")
    log.info("%s holds a latents conversion encoded in %s: continuing it so", out, precision)
    return precision


_LOADED: dict = {}  # (encoder settings, pid) -> (Encoders, device): built once per process


@dataclass(frozen=True)
class Encoder:
    """convert.pipeline's `Job.write_rows` for latents: plain data, so it crosses into worker
    processes, which each build the encoders on their own device at their first input."""

    preset: str
    pretrained: str | None
    resolutions: tuple[int, ...]
    batch_size: int = 16
    device: str | None = None
    workers: int = 1  # processes per rank: with LOCAL_RANK, which GPU each one takes
    t5: bool = False  # an mmdit preset's T5 context too (--t5)
    recipe: RecipeModel | None = None  # --recipe: the encoders of the model it builds, not the preset's
    precision: str = "fp32"  # bf16: the encoders cast to bf16, as the MLPerf Flux.1 reference runs them

    def process_index(self) -> tuple[int, int]:
        """(this process's index among the node's conversion processes, how many there are)."""
        from convert.pipeline import worker_slot

        local_rank, local_world = (
            int(os.environ.get("LOCAL_RANK", 0)),
            int(os.environ.get("LOCAL_WORLD_SIZE", 1)),
        )
        return local_rank * self.workers + worker_slot(), local_world * self.workers

    def pick_device(self) -> torch.device:
        """--device as given when it names one (cpu, cuda:1); else (unset or `cuda`) the node's
        i-th conversion process takes cuda:i (modulo the GPUs), or the CPU when there are none."""
        if self.device not in (None, "cuda"):
            return torch.device(self.device)
        gpus = torch.cuda.device_count()
        if gpus == 0:
            return torch.device(self.device or "cpu")
        return torch.device("cuda", self.process_index()[0] % gpus)

    def load(self) -> tuple[Encoders, torch.device]:
        key = (self, os.getpid())
        if key not in _LOADED:
            device = self.pick_device()
            index, processes = self.process_index()
            if device.type == "cpu" and processes > 1:  # share the cores, do not oversubscribe them
                torch.set_num_threads(
                    max(1, min(torch.get_num_threads(), (os.cpu_count() or 1) // processes))
                )
            if device.type == "cuda":
                torch.cuda.set_device(device)
            _LOADED.clear()
            encoders = (
                recipe_encoders(self.recipe)
                if self.recipe is not None
                else load_encoders(self.preset, self.pretrained, self.t5)
            )
            _LOADED[key] = (encoders.to(device, PRECISIONS[self.precision]), device)
            log.info("process %d of %d encodes on %s", index, processes, device)
        return _LOADED[key]

    def __call__(self, part: Part, job, writer, progress=None) -> tuple[Counter, Counter]:
        model, device = self.load()
        empty_caption.ensure(job.store, job.digest, model, device)  # before any of this input's rows
        # a GPU outruns one core's JPEG decoding: decode in threads (PIL lets go of the GIL)
        threads = (
            min(8, max(1, (os.cpu_count() or 1) // self.process_index()[1])) if device.type == "cuda" else 1
        )
        skipped, pending = Counter(), 0
        samples = encode_rows(
            part.samples(), model, self.resolutions, self.preset, self.batch_size, device, threads
        )
        for result in samples:
            if isinstance(result, Skipped):
                skipped[result.reason] += 1
                log.debug("%s: skipped %s: %s", part.name, result.key, result.reason)
            else:
                writer.write(result[1], result[0])
            pending += 1
            if progress is not None and pending >= self.batch_size:
                progress(pending)
                pending = 0
        if progress is not None and pending:
            progress(pending)
        return skipped, Counter()


def convert_latents(
    src: str,
    out: str,
    resolutions: list[int],
    preset: str = "sd2-base",
    pretrained: str | None = None,
    batch_size: int = 16,
    device: str | None = None,
    *,
    workers: int = 1,
    work_dir: str | Path | None = None,
    progress: bool = True,
    overwrite: bool = False,
    group=None,
    t5: bool = False,
    recipe: RecipeModel | None = None,
    precision: str | None = None,
) -> dict:
    """Encode the MDS image-caption set at `src` with `preset`'s frozen VAE and text encoder(s) (loaded
    from `pretrained`, a diffusers folder or hub id; random weights without it, for tests; an mmdit
    preset's T5 too with `t5`, from `pretrained`) into `out`
    (a folder or s3:// URI), one input per source input; returns the run's report (convert.report).
    `workers` processes per rank of `group` (convert.ranks.launched_group) share the inputs.
    `recipe` (convert.encoders.recipe_model): encode with the model that run config builds instead,
    its preset, model.pretrained and T5 taking the place of `preset`, `pretrained` and `t5`.
    `precision`: the encoders' "fp32" or "bf16"; None: the family's (`default_precision`)."""
    from convert.pipeline import convert
    from convert.storage import open_store

    if recipe is not None:
        preset, pretrained, t5 = recipe_settings(recipe)
    else:
        # A preset with its own optional T5 (mmdit-tiny-t5) always stores T5's context: its model reads
        # it. (A family whose T5 is not optional, Flux, stores it as its `text_embeds`.)
        t5 = t5 or (preset in PRESETS and bundled_t5(preset) and families.of(preset).reads_t5)
        check_encoder_flags(preset, pretrained, t5)
    precision = precision or _held_precision(out, src, overwrite) or default_precision(preset)
    if precision not in PRECISIONS:
        raise ValueError(f"--precision {precision}: choose one of {list(PRECISIONS)}")
    parts, buckets = source_parts(src)
    resolutions = tuple(resolutions)
    options = LatentsOptions(resolutions, preset, pretrained, buckets, recipe=recipe, precision=precision)
    encoder = Encoder(preset, pretrained, resolutions, batch_size, device, workers, t5, recipe, precision)
    cols = preset_columns(preset, list(resolutions), t5)
    if EVAL_TIMESTEP in source_columns(src):
        cols[EVAL_TIMESTEP] = "int32"
    empty_caption.forget()  # a new run: each process checks the output once more
    report = convert(
        parts, out, options, cols, source="latents", src=str(src), workers=workers,
        work_dir=work_dir, progress=progress, overwrite=overwrite, write_rows=encoder, group=group,
    )  # fmt: skip
    if group is None or group.rank == 0:
        empty_caption.ensure_at_end(open_store(out), options.digest(cols), report, encoder.load)
    return report
