"""Which MDS sets a run reads, and how: streaming `Stream`s, aspect-ratio buckets, streaming settings.

`data.train` names one set (`local` / `remote`) or several (`streams`: a named map of `remote`,
`local` and one of `proportion` / `repeat` / `choose`, as streaming's `Stream` takes them). With
`buckets: true` each set is the output of `sd-convert ... --buckets` and every bucket becomes a
stream of its own, trained at its own size (data/buckets.py) with `batching_method: per_stream`, so
every batch comes from one bucket; a set's share (its proportion, or its size) is split over its
buckets by their sample counts.

`check_settings` validates the keys before anything is built; `resolve_streams` reads each set's
index.json (downloading it for a remote) and fails naming the stream when it cannot be read or is
empty, or when a bucketed set has no buckets.
"""

import json
import logging
import math
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

from compat.streaming import SHUFFLE_ALGOS, CloudDownloader, bytes_to_int
from data.buckets import bucket_ratio
from data.holdout import check_holdout

log = logging.getLogger(__name__)

SAMPLING_METHODS = ("balanced", "fixed")
BATCHING_METHODS = ("random", "stratified", "per_stream", "device_per_stream")
STREAM_KEYS = ("remote", "local", "proportion", "repeat", "choose")
WEIGHTS = ("proportion", "repeat", "choose")


@dataclass(frozen=True)
class StreamSpec:
    """One stream as streaming will read it; `bucket` is the aspect-ratio label or None."""

    name: str
    remote: str | None
    local: str | None
    samples: int
    proportion: float | None = None
    repeat: float | None = None
    choose: int | None = None
    bucket: str | None = None

    def stream_kwargs(self) -> dict:
        weights = {k: getattr(self, k) for k in WEIGHTS if getattr(self, k) is not None}
        return dict(remote=self.remote, local=self.local, **weights)


def check_settings(cfg) -> None:
    """The streams map and the streaming settings of a data config; errors name the key."""
    if cfg.streams is not None:
        if cfg.local is not None or cfg.remote is not None:
            raise ValueError("streams: give either streams or local/remote, not both")
        if not isinstance(cfg.streams, dict) or not cfg.streams:
            raise ValueError(
                f"streams must be a non-empty map of name -> {{remote, local, proportion}}, "
                f"got {cfg.streams!r}"
            )
        kinds = set()
        for name, stream in cfg.streams.items():
            where = f"streams.{name}"
            if not isinstance(stream, dict):
                raise ValueError(f"{where} must be a mapping with remote/local, got {stream!r}")
            if unknown := set(stream) - set(STREAM_KEYS):
                raise ValueError(f"{where}: unknown keys {sorted(unknown)}; choose from {list(STREAM_KEYS)}")
            if stream.get("remote") is None and stream.get("local") is None:
                raise ValueError(
                    f"{where}: set local (an MDS folder) and/or remote (e.g. s3://bucket/prefix)"
                )
            given = [k for k in WEIGHTS if stream.get(k) is not None]
            if len(given) > 1:
                raise ValueError(f"{where}: give one of proportion, repeat, choose, not {given}")
            for key in given:
                value = stream[key]
                if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                    raise ValueError(f"{where}.{key} must be a positive number, got {value!r}")
            kinds.add(given[0] if given else None)
        if "proportion" in kinds:
            if kinds != {"proportion"}:
                raise ValueError("streams: when one stream has a proportion, every stream needs one")
            total = sum(s["proportion"] for s in cfg.streams.values())
            if not math.isclose(total, 1.0, abs_tol=1e-6):
                parts = " + ".join(f"{n} {s['proportion']:g}" for n, s in cfg.streams.items())
                raise ValueError(f"streams: the proportions add up to {total:g} ({parts}), not 1")
    if cfg.sampling_method not in SAMPLING_METHODS:
        raise ValueError(f"sampling_method={cfg.sampling_method!r}; choose one of {list(SAMPLING_METHODS)}")
    if cfg.batching_method not in BATCHING_METHODS:
        raise ValueError(f"batching_method={cfg.batching_method!r}; choose one of {list(BATCHING_METHODS)}")
    if cfg.shuffle_algo not in SHUFFLE_ALGOS:
        raise ValueError(f"shuffle_algo={cfg.shuffle_algo!r}; choose one of {sorted(SHUFFLE_ALGOS)}")
    if cfg.cache_limit is not None:
        try:
            bytes_to_int(cfg.cache_limit)
        except (ValueError, TypeError) as err:
            raise ValueError(
                f"cache_limit={cfg.cache_limit!r} is not a size like '500gb' or 10000000000"
            ) from err
    for key in ("predownload", "shuffle_block_size"):
        value = getattr(cfg, key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"{key} must be a positive integer, got {value!r}")
    if cfg.download_timeout is not None and cfg.download_timeout <= 0:
        raise ValueError(f"download_timeout must be positive seconds, got {cfg.download_timeout!r}")
    if cfg.buckets and cfg.batching_method != "per_stream":
        raise ValueError(
            "buckets: true needs batching_method: per_stream (every batch from one bucket), "
            f"got {cfg.batching_method!r}"
        )
    if getattr(cfg, "holdout", None) is not None:
        _check_holdout(cfg)


def _check_holdout(cfg) -> None:
    """A holdout this data config can keep out of every epoch (data/holdout.py)."""
    check_holdout(cfg.holdout)
    if cfg.buckets:
        raise ValueError(
            "holdout: not with buckets: true (a held-out batch would mix bucket sizes); evaluate a "
            "set of your own instead: data.eval, converted with sd-convert --buckets"
        )
    for name, stream in (cfg.streams or {}).items():
        fractional = stream.get("repeat") is not None and stream["repeat"] % 1
        if stream.get("proportion") is not None or stream.get("choose") is not None or fractional:
            raise ValueError(
                f"holdout: streams.{name} draws a different part of its samples each epoch (a proportion, "
                "a choose or a fractional repeat), from which no fixed set can be held out; weight the "
                "streams by a whole repeat or not at all, or evaluate a set of your own (data.eval)"
            )


def _configured(cfg) -> dict[str, dict]:
    if cfg.streams is not None:
        return {name: dict(stream) for name, stream in cfg.streams.items()}
    return {"data": {"remote": cfg.remote, "local": cfg.local}}


def read_index(remote: str | None, local: str | None, timeout: float = 60) -> dict:
    """A set's top-level index.json: `local`'s if it has one, else downloaded from `remote`."""
    if local is not None and Path(local, "index.json").is_file():
        return json.loads(Path(local, "index.json").read_text())
    if remote is None:
        raise FileNotFoundError(f"{local} holds no MDS dataset (no index.json)")
    # streaming 0.13's own downloader for the remote's scheme (s3, gs, oci, azure, hf, dbfs, sftp),
    # with the credentials and endpoint streaming itself will use (S3_ENDPOINT_URL, AWS_*).
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "index.json")
        CloudDownloader.direct_download(os.path.join(remote, "index.json"), path, timeout)
        return json.loads(Path(path).read_text())


def _counts_by_bucket(index: dict) -> dict[str, int]:
    counts: dict[str, int] = {}
    for shard in index.get("shards", []):
        first = shard["raw_data"]["basename"].split("/", 1)[0]
        label = first if bucket_ratio(first) is not None else ""
        counts[label] = counts.get(label, 0) + shard["samples"]
    return counts


def resolve_streams(cfg, split: str = "train") -> list[StreamSpec]:
    """The streams to read, buckets expanded; errors name the stream (`streams.<name>: ...`)."""
    specs = []
    for name, stream in _configured(cfg).items():
        where = "local/remote" if cfg.streams is None else f"streams.{name}"
        try:
            index = read_index(stream.get("remote"), stream.get("local"), cfg.download_timeout or 60)
        except Exception as err:  # noqa: BLE001 - any failure to read it is the same config problem
            source = stream.get("remote") or stream.get("local")
            raise ValueError(
                f"{where}: cannot read {source}/index.json ({type(err).__name__}: {err})"
            ) from err
        counts = _counts_by_bucket(index)
        total = sum(counts.values())
        if total == 0:
            raise ValueError(f"{where}: {stream.get('remote') or stream.get('local')} holds no samples")
        weights = {k: stream.get(k) for k in WEIGHTS}
        if not cfg.buckets:
            specs.append(StreamSpec(name, stream.get("remote"), stream.get("local"), total, **weights))
            continue
        if "" in counts:
            raise ValueError(
                f"{where}: buckets: true, but {counts['']} samples are outside any ar* bucket folder "
                "(convert with --buckets)"
            )
        for label, count in sorted(counts.items()):
            share = count / total
            specs.append(
                StreamSpec(
                    name=f"{name}/{label}",
                    remote=_join(stream.get("remote"), label),
                    local=_join(stream.get("local"), label),
                    samples=count,
                    proportion=None if weights["proportion"] is None else weights["proportion"] * share,
                    repeat=weights["repeat"],
                    choose=None if weights["choose"] is None else max(1, round(weights["choose"] * share)),
                    bucket=label,
                )
            )
    log.info("data.%s: %s", split, ", ".join(f"{s.name} ({s.samples} samples)" for s in specs))
    return specs


def _join(root: str | None, label: str) -> str | None:
    return None if root is None else f"{root.rstrip('/')}/{label}"


def streaming_settings(cfg) -> dict:
    """The StreamingDataset keyword arguments the config sets (None: streaming's own default)."""
    keys = ("cache_limit", "predownload", "download_timeout", "sampling_method", "batching_method")
    settings = {k: getattr(cfg, k) for k in keys if getattr(cfg, k) is not None}
    settings["shuffle_algo"] = cfg.shuffle_algo
    if cfg.shuffle_block_size is not None:
        settings["shuffle_block_size"] = cfg.shuffle_block_size
    return settings
