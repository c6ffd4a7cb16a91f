"""Which conversion an output holds, so that a rerun continues that one and no other.

Before writing any input, a run records its conversion in `<out>/sd-convert.json`: the source kind,
the source (an absolute path), the source settings and options that change what gets written (their
digest is the one in every completion marker), and the names of the inputs it may write. A rerun
whose conversion matches continues it; any other one stops with an error naming both, unless
--overwrite, which first deletes what the recorded conversion wrote there, and nothing else. An
output holding files that no conversion wrote is refused, --overwrite or not.

Outputs written before this record existed (completion markers, no record) are adopted: their
report's source, when there is one, must match, and the markers' digests are checked as before.
"""

import dataclasses
import json
import logging
from pathlib import Path

from convert.common import ConvertError
from data.latent_dataset import EMPTY_CAPTION

log = logging.getLogger(__name__)

RECORD = "sd-convert.json"
MARKERS = "_done"
REPORT = "convert-report.json"
INDEX = "index.json"
SAME = ("source", "src", "settings", "digest")  # what makes two runs one conversion


def where(src: str) -> str:
    """The source as recorded: absolute, so a rerun from another working directory matches."""
    if not src or "://" in src:
        return src
    return str(Path(src).expanduser().resolve())


def record(source: str, src: str, settings: dict, options, columns: dict, digest: str, names) -> dict:
    """The conversion as recorded, in JSON's types (tuples as lists), so that it compares equal to
    one read back."""
    rec = {
        "source": source,
        "src": where(src),
        "settings": settings,
        "digest": digest,
        "options": dataclasses.asdict(options),
        "columns": columns,
        "inputs": sorted(names),
    }
    return json.loads(json.dumps(rec))


def describe(rec: dict) -> str:
    """The conversion as the command that makes it: `folder --src /data/a --part-size 100`."""
    flags = ""
    for key, value in sorted(rec.get("settings", {}).items()):
        flag = "--" + key.replace("_", "-")
        if value is True:
            flags += f" {flag}"
        elif value is not None and value is not False:
            flags += f" {flag} {value}"
    return f"`{rec.get('source') or '?'} --src {rec.get('src') or '?'}{flags}`"


def _flat(tree: dict, prefix: str = "") -> dict:
    flat = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            flat.update(_flat(value, f"{prefix}{key}."))
        else:
            flat[prefix + key] = value
    return flat


def _option_changes(found: dict, wanted: dict) -> str:
    old, new = _flat(found.get("options", {})), _flat(wanted["options"])
    changed = [k for k in sorted(old.keys() | new.keys()) if old.get(k) != new.get(k)]
    shown = [f"{k.rsplit('.', 1)[-1]} {old.get(k)!r} there, {new.get(k)!r} now" for k in changed[:3]]
    if len(changed) > 3:
        shown.append(f"{len(changed) - 3} more")
    return "; ".join(shown) or "other output columns"


def _conflict(url: str, found: dict, wanted: dict) -> ConvertError:
    if all(found.get(k) == wanted[k] for k in SAME if k != "digest"):
        return ConvertError(
            f"--out {url} holds {describe(found)} converted with other options "
            f"({_option_changes(found, wanted)}): rerun with the same options, use a new --out, "
            "or pass --overwrite to delete that conversion first"
        )
    return ConvertError(
        f"--out {url} holds another conversion, {describe(found)}; this run is {describe(wanted)}: "
        "use a new --out, or pass --overwrite to delete that conversion first"
    )


def _matches(found: dict, wanted: dict) -> bool:
    if not found.get("legacy"):
        return all(found.get(k) == wanted[k] for k in SAME)
    # an older run's report (when it got that far) names its source; its markers, the options
    return found.get("source") in (None, wanted["source"]) and found.get("src") in (None, wanted["src"])


def _is_bucket(name: str) -> bool:
    try:
        return name.startswith("ar") and float(name[2:]) > 0
    except ValueError:
        return False


def _visible(store, rel: str = "") -> list[str]:
    # Hidden names are never a conversion's data: our lock and atomic-write temporaries, or OS and
    # editor droppings (.DS_Store), which should not make an output look foreign.
    return [name for name in store.entries(rel) if not name.startswith(".")]


def _found(store, entries: list[str]) -> dict | None:
    """The conversion the output holds (None: none), from its record or an older run's traces."""
    try:
        found = store.read_json(RECORD)
    except ValueError:
        raise ConvertError(f"--out {store.url}: {RECORD} is damaged; use a new --out") from None
    if found is not None or not ({MARKERS, REPORT} & set(entries)):
        return found
    report = store.read_json(REPORT) or {}
    src = report.get("src")
    return {"legacy": True, "source": report.get("source"), "src": where(src) if src else None}


def remove_conversion(store, found: dict, entries: list[str]) -> None:
    """Delete what the conversion `found` wrote to the store: its inputs' sub-datasets (in every
    bucket), markers, indexes, the empty caption's encodings (`sd-convert latents`), report and
    record; other files stay. The record goes last, so an --overwrite killed midway is finished by the
    next one."""
    names = set(found.get("inputs", ())) | set(store.list_names(MARKERS, ".json"))
    for entry in entries:
        if entry in names:
            store.clear(entry)
        elif _is_bucket(entry):
            inside = _visible(store, entry)
            for name in inside:
                if name in names:
                    store.clear(f"{entry}/{name}")
            if INDEX in inside:
                store.remove(f"{entry}/{INDEX}")
            if not _visible(store, entry):
                store.clear(entry)
    store.clear(MARKERS)
    for rel in (INDEX, EMPTY_CAPTION, REPORT, RECORD):
        store.remove(rel)


def check(store, wanted: dict, overwrite: bool) -> tuple[dict | None, list[str]]:
    """(the conversion the output holds or None, its visible entries), or a ConvertError naming both
    conversions when it holds another one (without `overwrite`) or files of no conversion. Reads
    only: the CLI calls it before a download or a long listing of the source, too."""
    entries = _visible(store)
    found = _found(store, entries)
    if found is None and entries:
        listed = ", ".join(entries[:3]) + (f" and {len(entries) - 3} more" if len(entries) > 3 else "")
        raise ConvertError(
            f"--out {store.url} holds files that sd-convert did not write ({listed}): use a new or empty "
            "--out (--overwrite deletes only what sd-convert wrote)"
        )
    if found is not None and not overwrite and not _matches(found, wanted):
        raise _conflict(store.url, found, wanted)
    return found, entries


def claim(store, wanted: dict, overwrite: bool) -> None:
    """`check`, then with `overwrite` delete the conversion found, and record `wanted` (its inputs
    added to those of the same conversion's earlier runs). Called with the output locked."""
    found, entries = check(store, wanted, overwrite)
    if found is not None and overwrite:
        log.warning("--overwrite: deleting %s from %s", describe(found), store.url)
        remove_conversion(store, found, entries)
        found = None
    inputs = set(wanted["inputs"]) | set(found.get("inputs", ()) if found else ())
    if found is None or found.get("legacy") or set(found.get("inputs", ())) != inputs:
        store.write_bytes(RECORD, json.dumps({**wanted, "inputs": sorted(inputs)}, indent=1).encode())
