"""Streaming dataset of precomputed latents, as written by `python -m convert latents`.

Rows hold `latents_{R}` (the VAE posterior's mean and logvar at resolution R, unscaled, fp16) and
`text_embeds` (77, D) fp16. The model samples from the moments and applies the latent scale itself,
so training on these is the same computation as training on the images.

An SDXL preset's rows also hold what its UNet reads besides (models/families/sdxl/model.py):
`pooled_text_embeds` (1280,) fp16, the second text encoder's projected pooled output, and the
micro-conditioning sizes, `original_size` (height, width) and per resolution `crop_top_left_{R}` (top, left)
int64, which a sample carries as `crop_top_left`. An mmdit preset's rows (models/families/mmdit/model.py) hold
`text_embeds` (77, 768 + 1280 for sd3-medium: both CLIPs' context, unpadded), `pooled_text_embeds` (2048,)
and, when converted with a T5, `text_embeds_3` (t5_tokens, 4096), all fp16. A set without a column (an SD
preset's) gives samples without its key.

Beside the shards, `sd-convert latents` writes the empty caption's stored form once per set
(EMPTY_CAPTION: the same tensors for "", not rounded to fp16 (bf16 values when the encoders ran in
bf16: `--precision`; `sd-convert mlperf-flux` stores the reference's own fp16 ones), as the MLPerf
Flux.1 reference keeps
t5_empty.npy and clip_empty.npy beside its preprocessed set), which caption dropout uses
(`read_empty_caption`; recipes/trainer.py hands it to the model once), so a run on precomputed
encodings needs no text encoder. A set converted before it was written has none: the model encodes "".
"""

import json
import logging
import os
import tempfile
from pathlib import Path

import torch

from data.streaming_base import StreamingBase
from data.streams import _configured, read_index
from models.engine.draw_keys import SAMPLE_INDEX
from models.engine.eval_timesteps import STORED as EVAL_TIMESTEP  # noqa: F401 - read here, and by convert/

log = logging.getLogger(__name__)

EMPTY_CAPTION = "empty_caption.safetensors"
# The stored form's columns (models/engine/conditioners.py), which the empty caption's file holds too.
TEXT_COLUMNS = ("text_embeds", "pooled_text_embeds", "text_embeds_3")


def latents_column(resolution: int) -> str:
    return f"latents_{resolution}"


def crop_column(resolution: int) -> str:
    return f"crop_top_left_{resolution}"


class LatentsDataset(StreamingBase):
    def __init__(self, *, resolution: int, **streaming_kwargs):
        super().__init__(**streaming_kwargs)
        self.column = latents_column(resolution)
        self.crop_column = crop_column(resolution)

    def __getitem__(self, index):
        sample = super().__getitem__(index)
        if self.column not in sample:
            have = sorted(k for k in sample if k.startswith("latents_"))
            raise KeyError(
                f"no {self.column} column in this dataset (it has {have}); convert at this resolution"
            )
        # One copy into writable float32 memory: from_numpy(...).float() kept fp32 columns in the
        # read-only sample buffer, and torch warns about that in every worker.
        out = {
            "latents": torch.tensor(sample[self.column], dtype=torch.float32),
            "text_embeds": torch.tensor(sample["text_embeds"], dtype=torch.float32),
        }
        for name in ("pooled_text_embeds", "text_embeds_3"):
            if name in sample:
                out[name] = torch.tensor(sample[name], dtype=torch.float32)
        if "original_size" in sample:
            out["original_size"] = torch.tensor(sample["original_size"], dtype=torch.int64)
        if self.crop_column in sample:
            out["crop_top_left"] = torch.tensor(sample[self.crop_column], dtype=torch.int64)
        if EVAL_TIMESTEP in sample:  # a set with its own fixed validation timesteps (MLPerf's COCO)
            out[EVAL_TIMESTEP] = int(sample[EVAL_TIMESTEP])
        out[SAMPLE_INDEX] = int(index)  # training draws keyed per sample (models/engine/draw_keys.py)
        return out


def load_empty_caption(data: bytes) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """(tensors, metadata) of an EMPTY_CAPTION file's bytes (safetensors: an 8-byte header length, then
    the JSON header, whose `__metadata__` holds the conversion's digest)."""
    from safetensors.torch import load

    header = json.loads(data[8 : 8 + int.from_bytes(data[:8], "little")])
    return load(data), header.get("__metadata__") or {}


def _missing(err: Exception) -> bool:
    """Whether reading a set's file failed because it is not there: no local file, or S3's 404 (or 403:
    without the ListBucket right S3 answers 403 for a missing key, and the set's index.json, from the
    same place, was read already)."""
    code = getattr(err, "response", {}).get("Error", {}).get("Code")
    return isinstance(err, FileNotFoundError) or code in ("404", "NoSuchKey", "403")


def read_set_file(remote: str | None, local: str | None, name: str, timeout: float = 60) -> bytes | None:
    """A set's top-level file `name`: `local`'s if it has one, else downloaded from `remote` (as
    data/streams.read_index reads index.json); None when neither has it."""
    from compat.streaming import CloudDownloader

    if local is not None and Path(local, name).is_file():
        return Path(local, name).read_bytes()
    if remote is None:
        return None
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, name)
        try:
            CloudDownloader.direct_download(os.path.join(remote, name), path, timeout)
        except Exception as err:
            if _missing(err):
                return None
            raise
        return Path(path).read_bytes()


def read_empty_caption(cfg) -> dict[str, torch.Tensor] | None:
    """The empty caption's stored form of the precomputed set(s) `cfg` (data.train) names, from their
    EMPTY_CAPTION files; None when none has one (sets converted before it was written: the model
    encodes "" itself, as before). Sets that hold different ones were encoded with different text
    encoders: a ValueError, as is a file whose tensors are not the set's text columns."""
    found, without = {}, []
    for name, stream in _configured(cfg).items():
        remote, local = stream.get("remote"), stream.get("local")
        data = read_set_file(remote, local, EMPTY_CAPTION, cfg.download_timeout or 60)
        if data is None:
            without.append(name)
            continue
        tensors, _ = load_empty_caption(data)
        index = read_index(remote, local, cfg.download_timeout or 60)
        columns = {c for shard in index.get("shards", []) for c in shard.get("column_names", [])}
        if set(tensors) != columns & set(TEXT_COLUMNS):
            raise ValueError(
                f"{remote or local}/{EMPTY_CAPTION} holds {sorted(tensors)}, not the set's text columns "
                f"{sorted(columns & set(TEXT_COLUMNS))}: reconvert the set with `sd-convert latents`"
            )
        found[name] = tensors
    if not found:
        return None
    (first, empty), *others = found.items()
    for name, tensors in others:
        if tensors.keys() != empty.keys() or not all(torch.equal(v, empty[k]) for k, v in tensors.items()):
            raise ValueError(
                f"streams {first} and {name} hold different empty captions ({EMPTY_CAPTION}): they were "
                "encoded with different text encoders; convert them with the same ones"
            )
    if without:
        log.warning(
            "%s: no %s (converted before it was written); caption dropout uses %s's for every set",
            ", ".join(without), EMPTY_CAPTION, first,
        )  # fmt: skip
    return empty
