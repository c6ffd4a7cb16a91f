"""The data against the recipe, before anything is built: what each set's index.json says it holds.

`check_data` reads the index.json of every set a run names (downloading it for a remote; a few KB)
and fails with one line naming the key and the fix when:
- a local set's shard is missing or not the size its index.json gives (a truncated copy);
- the columns are not what the run reads: images under a latents recipe or the reverse, latents at
  another resolution, latents made for another preset (their `sd-convert.json` names the preset;
  without one, the columns the run's family reads must be there);
- the training set (or, with `batching_method: per_stream`, one of its streams or aspect-ratio
  buckets) holds fewer samples than one global batch: with `drop_last` it would give no batch, and
  Composer 0.32 then loops over empty epochs for ever ("No batches were trained"), counted without
  the samples `data.train.holdout` keeps out; or that holdout is the whole set.
An image folder given where an MDS set belongs is named as such, with the `sd-convert` command.
"""

import json
import logging
from pathlib import Path

from data.holdout import held_per_stream, holdout_count
from data.streams import WEIGHTS, _configured, read_index

log = logging.getLogger(__name__)

IMAGE_SUFFIXES = {".jpg", ".jpeg", ".png", ".webp", ".bmp", ".gif", ".tif", ".tiff"}
CONVERT_RECORD = "sd-convert.json"  # convert/identity.py: what a conversion wrote, and with what


def check_data(data_cfg, key: str, preset: str, global_batch: int | None) -> None:
    """Raise ValueError naming `key` (`data.train`) for the problems the module docstring lists.
    `global_batch`: the training set's batch (None for an evaluation set, which keeps its last,
    partial batch)."""
    reads_latents = data_cfg.latents
    for name, stream in _configured(data_cfg).items():
        where = key if data_cfg.streams is None else f"{key}.streams.{name}"
        remote, local = stream.get("remote"), stream.get("local")
        source = remote or local
        index = _index(where, remote, local, data_cfg.download_timeout or 60)
        if remote is None:
            check_shards(where, Path(local), index)
        columns = _columns(index)
        if preset.endswith("-vae") or not reads_latents:
            _check_image_columns(where, source, columns, data_cfg, preset)
        else:
            _check_latent_columns(where, source, columns, data_cfg, preset, remote, local)
    if getattr(data_cfg, "holdout", None) is not None:  # a holdout of the whole set leaves no training
        from data.streams import resolve_streams

        holdout_count(data_cfg.holdout, sum(s.samples for s in resolve_streams(data_cfg)), f"{key}.holdout")
    if global_batch is not None and data_cfg.drop_last:
        check_batches(data_cfg, key, global_batch)


def _index(where: str, remote: str | None, local: str | None, timeout: float) -> dict:
    if remote is None and local is not None and (problem := local_problem(where, local)):
        raise ValueError(problem)
    try:
        return read_index(remote, local, timeout)
    except json.JSONDecodeError as err:
        raise ValueError(
            f"{where}: {remote or local}/index.json is not valid JSON ({err}); reconvert"
        ) from err
    except Exception as err:  # noqa: BLE001 - any failure to read it is one config problem
        raise ValueError(
            f"{where}: cannot read {remote or local}/index.json ({type(err).__name__}: {err})"
        ) from err


def local_problem(where: str, local: str) -> str | None:
    """What is wrong with a local folder given as an MDS set: missing, a file, not MDS; else None."""
    folder = Path(local)
    if not folder.exists():
        return f"{where}.local={local} does not exist"
    if not folder.is_dir():
        return f"{where}.local={local} is a file, not an MDS folder"
    if not (folder / "index.json").is_file():
        return not_mds(where, folder)
    return None


def not_mds(where: str, folder: Path) -> str:
    """A folder without index.json: say what it holds (images to convert, or nothing usable)."""
    images = 0
    for path in folder.rglob("*"):
        if path.suffix.lower() in IMAGE_SUFFIXES:
            images += 1
            if images >= 1000:
                break
    if images:
        count = f"{images}{'+' if images >= 1000 else ''}"
        return (
            f"{where}.local={folder} holds {count} image files, not an MDS dataset (no index.json); "
            f"convert it first: sd-convert folder --src {folder} --out runs/data/NAME, then "
            "train with data.train.local=runs/data/NAME"
        )
    return (
        f"{where}.local={folder} holds no MDS dataset (no index.json); point it at sd-convert's --out folder"
    )


def check_shards(where: str, local: Path, index: dict) -> None:
    """Every shard a local set's index.json lists is there at the size it gives (raw or compressed)."""
    for shard in index.get("shards", []):
        raw, zipped = shard.get("raw_data") or {}, shard.get("zip_data") or {}
        found = False
        for part in (raw, zipped):
            if not part.get("basename"):
                continue
            path = local / part["basename"]
            if not path.is_file():
                continue
            found = True
            size = path.stat().st_size
            if part.get("bytes") is not None and size != part["bytes"]:
                raise ValueError(
                    f"{where}: shard {path} is {size:,} bytes, but index.json says {part['bytes']:,}: "
                    "a truncated or damaged copy; copy it again or reconvert the set"
                )
        if not found:
            raise ValueError(
                f"{where}: shard {local / raw.get('basename', '?')} listed in index.json is missing; "
                "copy the whole set folder or reconvert it"
            )


def _columns(index: dict) -> set[str]:
    names: set[str] = set()
    for shard in index.get("shards", []):
        names.update(shard.get("column_names") or [])
    return names


def _describe(columns: set[str]) -> str:
    shown = sorted(columns - {"key"})
    return ", ".join(shown[:8]) + (", ..." if len(shown) > 8 else "")


def _check_image_columns(where, source, columns, cfg, preset) -> None:
    latents = sorted(c for c in columns if c.startswith("latents_"))
    if latents and cfg.image_key not in columns:
        raise ValueError(
            f"{where}: {source} holds precomputed latents ({_describe(columns)}), not images; "
            + (
                "a VAE trains on images: point it at the image set"
                if preset.endswith("-vae")
                else f"add {where.split('.streams.')[0]}.latents=true to train on them"
            )
        )
    for column, option in ((cfg.image_key, "image_key"), (cfg.caption_key, "caption_key")):
        if column not in columns and not (preset.endswith("-vae") and option == "caption_key"):
            raise ValueError(
                f"{where}: {source} has no '{column}' column (it has {_describe(columns)}); "
                f"set {where.split('.streams.')[0]}.{option} to the right column"
            )


def _check_latent_columns(where, source, columns, cfg, preset, remote, local) -> None:
    from convert.latents import preset_columns

    have = sorted(int(c.split("_", 1)[1]) for c in columns if c.startswith("latents_") and c[8:].isdigit())
    data_key = where.split(".streams.")[0]
    if not have:
        raise ValueError(
            f"{where}: {source} holds images ({_describe(columns)}), not precomputed latents; make them "
            f"with `sd-convert latents --src {source} --out OUT --preset {preset} --resolution "
            f"{cfg.resolution}` or set {data_key}.latents=false"
        )
    if cfg.resolution not in have:
        raise ValueError(
            f"{where}: {source} holds latents at {', '.join(f'{r} px' for r in have)}, not at "
            f"{data_key}.resolution={cfg.resolution}; set {data_key}.resolution to one of them or "
            f"convert at {cfg.resolution}"
        )
    made_with = _recorded_preset(remote, local)
    if made_with is not None and not same_latents(made_with, preset):
        raise ValueError(
            f"{where}: {source} holds latents made for preset {made_with} (its {CONVERT_RECORD}), "
            f"and this run's model.preset is {preset}; make them with sd-convert latents --preset {preset}"
        )
    needed = set(preset_columns(preset, [cfg.resolution])) - {"caption", "key"}
    missing = sorted(needed - columns)
    if missing:
        raise ValueError(
            f"{where}: {source} lacks {', '.join(missing)}, which preset {preset} reads: the latents were "
            f"made for another model family; make them with sd-convert latents --preset {preset}"
        )


def _recorded_preset(remote: str | None, local: str | None) -> str | None:
    """The preset `sd-convert latents` recorded (local sets only: a remote's record is not fetched)."""
    if local is None or remote is not None:
        return None
    path = Path(local, CONVERT_RECORD)
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    options = record.get("options") if isinstance(record, dict) else None
    return options.get("preset") if isinstance(options, dict) else None


def same_latents(made_with: str, preset: str) -> bool:
    """Whether latents encoded for `made_with` are what `preset` reads: the same family, latent
    channels and VAE factor, and text encoders of the same widths."""
    from models.presets import vae_factor
    from models.registry import PRESETS, family

    if made_with == preset:
        return True
    if made_with not in PRESETS or preset not in PRESETS:
        return False

    def signature(name):
        spec = PRESETS[name]
        # A CLIP's hidden_size, a T5's d_model (Flux's text_encoder_2).
        encoders = [spec[k] for k in ("text_encoder", "text_encoder_2") if k in spec]
        widths = tuple(e.get("hidden_size", e.get("d_model")) for e in encoders)
        return family(name), spec["vae"]["latent_channels"], vae_factor(name), widths

    return signature(made_with) == signature(preset)


def epoch_samples(data_cfg) -> dict[str, int]:
    """Samples per epoch of each stream (bucket streams apart), as streaming draws them: `choose`
    exactly, `repeat` times its size, a `proportion` of the sets' total, else its size."""
    from data.streams import resolve_streams

    specs = resolve_streams(data_cfg)
    total = sum(s.samples for s in specs)
    # data.train.holdout's samples are left out of every epoch; it allows only whole repeats
    holdout = getattr(data_cfg, "holdout", None)
    held = held_per_stream([s.samples for s in specs], holdout) if holdout is not None else [0] * len(specs)
    out = {}
    for spec, kept_out in zip(specs, held):
        weights = {k: getattr(spec, k) for k in WEIGHTS}
        if weights["choose"] is not None:
            out[spec.name] = int(weights["choose"])
        elif weights["repeat"] is not None:
            out[spec.name] = int((spec.samples - kept_out) * weights["repeat"])
        elif weights["proportion"] is not None:
            out[spec.name] = int(total * weights["proportion"])
        else:
            out[spec.name] = spec.samples - kept_out
    return out


def check_batches(data_cfg, key: str, global_batch: int) -> None:
    """The epoch (and with per-stream batching each stream or bucket) holds one global batch."""
    counts = epoch_samples(data_cfg)
    total = sum(counts.values())
    fix = (
        f"lower global_train_batch_size to {max(1, total)} or less, or add samples"
        if total
        else "add samples"
    )
    if total < global_batch:
        raise ValueError(
            f"{key}: an epoch holds {total} samples, fewer than one global batch "
            f"(global_train_batch_size={global_batch}), so no batch could be formed; {fix}"
        )
    if data_cfg.batching_method in ("per_stream", "device_per_stream"):
        small = {name: n for name, n in counts.items() if n < global_batch}
        if small:
            listed = ", ".join(f"{name} ({n})" for name, n in sorted(small.items()))
            raise ValueError(
                f"{key}: with batching_method {data_cfg.batching_method} every batch comes from one "
                f"stream, and {listed} hold fewer samples than one global batch "
                f"(global_train_batch_size={global_batch}): they would never be trained on; lower the "
                "batch, merge those buckets/streams, or leave them out"
            )
    log.debug("%s: %d samples an epoch, %d batches of %d", key, total, total // global_batch, global_batch)
