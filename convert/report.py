"""The end of a run: merge the finished inputs' indexes into the top-level index.json (and one per
aspect-ratio bucket), and build the convert-report.json / summary line from the completion markers."""

import dataclasses
import json
import logging
import shutil
import tempfile
from collections import Counter
from pathlib import Path

from compat.streaming import UPLOAD_LOGGER, merge_index

log = logging.getLogger(__name__)


class _DropMergeNotices(logging.Filter):
    # merge_index announces its temporary folder (root logger) and that the output folder exists
    # (streaming's upload logger) at WARNING on every call: noise, as both are expected here
    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not (message.startswith("A temporary folder") or "exists and not empty" in message)


NOISY_LOGGERS = ("", UPLOAD_LOGGER)


def merge_indexes(store, markers: list[dict], work_dir: Path) -> None:
    """Write `index.json` (every finished input) and `<bucket>/index.json` (with buckets) to the store.

    The markers carry each input's index.json, so the merge reads nothing back from the output: they
    are laid out in a local scratch tree mirroring the output and merged there with streaming's
    merge_index, whose shard paths are `<parent folder>/<basename>`, one level deep; two levels
    (bucket/input/) come from merging the per-bucket merged indexes once more.
    """
    if not markers:
        log.warning("no input finished, so no index.json was written")
        return
    work_dir.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix="merge-", dir=work_dir))
    quiet = _DropMergeNotices()
    for name in NOISY_LOGGERS:
        logging.getLogger(name).addFilter(quiet)
    try:
        buckets = sorted({bucket for marker in markers for bucket in marker["buckets"]})
        top: list[str] = []
        for bucket in buckets:
            base = scratch / bucket if bucket else scratch
            paths = []
            for marker in markers:
                if bucket in marker["buckets"]:
                    path = base / marker["input"] / "index.json"
                    path.parent.mkdir(parents=True)
                    path.write_text(json.dumps(marker["buckets"][bucket]["index"]))
                    paths.append(str(path))
            if bucket:
                merge_index(paths, str(base))
                store.write_bytes(f"{bucket}/index.json", (base / "index.json").read_bytes())
                top.append(str(base / "index.json"))
            else:
                top = paths
        if top:
            merge_index(top, str(scratch))
            store.write_bytes("index.json", (scratch / "index.json").read_bytes())
    finally:
        for name in NOISY_LOGGERS:
            logging.getLogger(name).removeFilter(quiet)
        shutil.rmtree(scratch, ignore_errors=True)


def _total(markers, field: str) -> dict:
    total = Counter()
    for marker in markers:
        total.update(marker[field])
    return dict(sorted(total.items()))


def build_report(source, src, out, options, parts, done, failed, this_run, seconds, error=None) -> dict:
    """Totals over every finished input (this run and earlier ones), plus what this run did."""
    markers = list(done.values())
    run_written = sum(m["samples_written"] for m in this_run)
    run_seen = run_written + sum(sum(m["samples_skipped"].values()) for m in this_run)
    buckets = Counter()
    for marker in markers:
        buckets.update({b: entry["rows"] for b, entry in marker["buckets"].items()})
    report = {
        "source": source,
        "src": src,
        "out": out,
        "complete": len(done) == len(parts) and error is None,
        "inputs_total": len(parts),
        "inputs_done": len(done),
        "inputs_done_this_run": len(this_run),
        "inputs_failed": failed,
        "samples_written": sum(m["samples_written"] for m in markers),
        "samples_skipped": _total(markers, "samples_skipped"),
        "samples_repaired": _total(markers, "samples_repaired"),
        "this_run": {
            "samples_written": run_written,
            "samples_seen": run_seen,
            "seconds": round(seconds, 3),
            "samples_per_second": round(run_seen / seconds, 1) if seconds > 0 else None,
        },
        "options": dataclasses.asdict(options),
        "inputs": sorted(done),
    }
    if options.buckets:
        report["buckets"] = dict(sorted(buckets.items()))
    if error is not None:
        report["error"] = error
    return report


def summary_line(report: dict) -> str:
    skipped = report["samples_skipped"]
    reasons = ", ".join(f"{reason} {n}" for reason, n in sorted(skipped.items(), key=lambda kv: -kv[1]))
    run = report["this_run"]
    line = (
        f"{report['inputs_done']}/{report['inputs_total']} inputs done "
        f"({report['inputs_done_this_run']} this run); {report['samples_written']} samples written, "
        f"{sum(skipped.values())} skipped{f' ({reasons})' if reasons else ''}, "
        f"{sum(report['samples_repaired'].values())} repaired; "
        f"this run {run['samples_seen']} samples in {run['seconds']:.1f} s "
        f"({run['samples_per_second'] or 0:.0f} samples/s) -> {report['out']}"
    )
    if report["inputs_failed"]:
        line += f"; {len(report['inputs_failed'])} inputs FAILED (rerun to retry; see convert-report.json)"
    return line


def run_failure(report: dict) -> str | None:
    """Why a run that finished must still exit non-zero, in one line, or None. Every input failing
    (none done, now or before) or no sample written at all leaves nothing to train on; some inputs
    failing is a partial result, counted in the report and retried by the next run (exit 0)."""
    failed, where = report["inputs_failed"], f"{report['out'].rstrip('/')}/convert-report.json"
    if failed and not report["inputs_done"]:
        name, error = min(failed.items())
        error = " ".join(str(error).split())  # one line, whatever the exception said
        return f"every input failed ({len(failed)} of {report['inputs_total']}; {name}: {error}); see {where}"
    if report["complete"] and report["samples_written"] == 0:
        skipped = report["samples_skipped"]
        reasons = ", ".join(f"{reason} {n}" for reason, n in sorted(skipped.items(), key=lambda kv: -kv[1]))
        return f"no sample was written: every one was skipped ({reasons or 'none seen'}); see {where}"
    return None
