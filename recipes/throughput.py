"""The throughput `recipes.plan` prices a run at: `--img-per-sec-per-gpu`, or the JSON file a
throughput benchmark (bench/throughput.py) writes with `write_throughput`, which records the preset
it was measured on; `rate_note` is the line the planner prints when that is not the run's preset."""

import json
from dataclasses import dataclass
from pathlib import Path

from recipes.compose import load_config
from recipes.config import ConfigError


@dataclass(frozen=True)
class Throughput:
    img_per_sec_per_gpu: float
    resolution: int | None = None  # the training resolution it was measured at
    device: str | None = None  # e.g. "8x A100-40GB"; for the record
    source: str = "--img-per-sec-per-gpu"
    preset: str | None = None  # the model preset it was measured on, when known


def write_throughput(path: str | Path, img_per_sec_per_gpu: float, resolution: int, device: str, **extra):
    """What a throughput benchmark writes for `--throughput-file` (extra keys are kept, not read)."""
    record = {"img_per_sec_per_gpu": img_per_sec_per_gpu, "resolution": resolution, "device": device, **extra}
    Path(path).write_text(json.dumps(record, indent=2) + "\n")


def read_throughput(path: str | Path) -> Throughput:
    try:
        record = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ConfigError(f"cannot read throughput file {path}: {err}") from err
    value = record.get("img_per_sec_per_gpu") if isinstance(record, dict) else None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise ConfigError(f"throughput file {path} needs a positive 'img_per_sec_per_gpu', got {value!r}")
    preset = record.get("preset") or _recipe_preset(record.get("recipe"), record.get("overrides") or [])
    return Throughput(float(value), record.get("resolution"), record.get("device"), str(path), preset)


def _recipe_preset(recipe, overrides) -> str | None:
    """The preset of the recipe a throughput file names (files written before they recorded it)."""
    if not isinstance(recipe, str):
        return None
    try:
        return str(load_config(recipe, [str(o) for o in overrides]).model.preset)
    except Exception:  # noqa: BLE001 - a moved or broken recipe only means the preset is unknown
        return None


# The preset whose rate this repo has measured (docs/benchmarks.md) and its docs quote.
MEASURED_PRESET = "sd2-base"


def rate_note(preset: str, throughput: Throughput) -> str | None:
    """A line saying that the rate is another model's, when the run's preset is not the one it was
    measured on (or, for a bare --img-per-sec-per-gpu, not sd2-base, the only one measured here)."""
    if throughput.preset is not None:
        if throughput.preset == preset:
            return None
        return (
            f"note: the rate was measured on preset {throughput.preset} ({throughput.source}), not {preset}: "
            f"the days and cost below are {throughput.preset}'s rate applied to {preset}; measure {preset} "
            "with bench/throughput.py for its own"
        )
    if preset == MEASURED_PRESET:
        return None
    return (
        f"note: {throughput.img_per_sec_per_gpu:g} img/s per GPU is used for {preset} as given; this repo "
        f"has measured only {MEASURED_PRESET}'s rate (137.5 img/s per A100 published, the H100 figures in "
        f"docs/benchmarks.md), so a rate taken from those is SD2's, not {preset}'s: measure {preset} "
        "with bench/throughput.py"
    )
