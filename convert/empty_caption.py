"""The empty caption's stored form, written once per `sd-convert latents` output beside its index.json
(data/latent_dataset.EMPTY_CAPTION), so that caption dropout on the precomputed set needs no text
encoder: the MLPerf Flux.1 reference keeps t5_empty.npy and clip_empty.npy beside its preprocessed set
for this, and without it a Flux run would load T5-XXL only to encode "".

What: the family conditioner's `encode` of "" with the conversion's own encoders, the call that made
the set's text columns, not rounded to fp16 (the columns are; the model's own encoding of "" is not),
so the loss is bitwise the one of a model encoding "" with the same encoders in the same precision
(`--precision`: a flux preset's encode in bf16, the model's own in fp32); safetensors, with the
conversion's digest (the one in its completion markers) in the metadata.
When: each conversion process writes it at its first input, before any row of that input, unless the
output holds this conversion's already; so every completion marker comes after it. A rerun whose
inputs were all done before (by code older than this file) writes it at the end (`ensure_at_end`).
How: one atomic write (local: a temporary file renamed; S3: one PUT), so a reader sees all of it or
none of it, and processes that write it at once write the same tensors. --overwrite deletes it with the
conversion (convert/identity.py), and a file of another conversion is replaced.
"""

import logging
import os

from data.latent_dataset import EMPTY_CAPTION, load_empty_caption

log = logging.getLogger(__name__)

_WRITTEN: set = set()  # (output, digest, pid): checked or written by this process


def empty_caption_bytes(encoders, device, digest: str) -> bytes:
    """The EMPTY_CAPTION file of `encoders` (convert/encoders.Encoders, or a model: anything with a
    `conditioner` and its parts) on `device`, for the conversion `digest`."""
    from safetensors.torch import save

    conditioner = encoders.conditioner
    ids = {name: value.to(device) for name, value in conditioner.ids(encoders, [""]).items()}
    stored = conditioner.encode(encoders, ids)
    tensors = {name: value.detach().cpu().contiguous() for name, value in stored.items()}
    return save(tensors, metadata={"caption": "", "options": digest})


def held_digest(store) -> str | None:
    """The digest of the conversion whose EMPTY_CAPTION the output holds; None when it holds none."""
    data = store.read_bytes(EMPTY_CAPTION)
    return None if data is None else load_empty_caption(data)[1].get("options")


def ensure(store, digest: str, encoders, device) -> None:
    """Write the output's EMPTY_CAPTION unless it holds this conversion's (checked once per process
    and run: the inputs after the first find it written)."""
    key = (store.url, digest, os.getpid())
    if key not in _WRITTEN and held_digest(store) != digest:
        write(store, digest, encoders, device)
    _WRITTEN.add(key)


def forget() -> None:
    """Start a run: what an earlier run in this process checked may have gone since (--overwrite)."""
    _WRITTEN.clear()


def write(store, digest: str, encoders, device) -> None:
    store.write_bytes(EMPTY_CAPTION, empty_caption_bytes(encoders, device, digest))
    log.info("wrote the empty caption's encodings to %s/%s", store.url, EMPTY_CAPTION)


def ensure_at_end(store, digest: str, report: dict, load) -> None:
    """After a run that left inputs done: write EMPTY_CAPTION if the output lacks this conversion's
    (its inputs were all converted before the file existed), with the encoders `load()` gives
    (encoders, device), loaded only then."""
    if not report.get("inputs_done") or held_digest(store) == digest:
        return
    log.info("%s has no %s of this conversion: encoding the empty caption", store.url, EMPTY_CAPTION)
    write(store, digest, *load())
