"""MDS writing: `write_mds` for one sample stream into one dataset, `PartWriter` for one input's
samples into one sub-dataset per aspect-ratio bucket (what convert.pipeline runs per input)."""

import json
import logging
import shutil
from collections import Counter
from collections.abc import Iterable
from pathlib import Path

from streaming import MDSWriter
from tqdm import tqdm

from convert.common import BASE_COLUMNS, Skipped
from convert.samples import bucket_name

log = logging.getLogger(__name__)


def write_mds(
    samples: Iterable[dict | Skipped], out: str, columns: dict = BASE_COLUMNS, compression: str | None = None
) -> dict:
    """Write the samples to an MDS dataset at `out`; return (and save beside it) the report."""
    written, skipped = 0, Counter()
    with MDSWriter(out=out, columns=columns, compression=compression) as writer:
        for sample in tqdm(samples, desc=f"convert -> {out}", unit="sample"):
            if isinstance(sample, Skipped):
                skipped[sample.reason] += 1
                log.debug("skipped %s: %s", sample.key, sample.reason)
                continue
            writer.write(sample)
            written += 1
    report = {"samples_written": written, "samples_skipped": dict(skipped)}
    if "://" not in out:
        Path(out, "convert-report.json").write_text(json.dumps(report, indent=2))
    log.info("wrote %d samples to %s, skipped %d %s", written, out, sum(skipped.values()), dict(skipped))
    return report


class PartWriter:
    """Rows of one input -> `<root>/<bucket>/<name>/` MDS folders (`<root>/<name>/` without buckets).

    Writers open lazily, so a bucket the input never reaches gets no folder. `close` returns each
    bucket's row count and index.json, which the completion marker keeps so the final merge needs
    no extra reads from the output.
    """

    def __init__(
        self, root: Path, name: str, columns: dict, buckets=(), compression=None, size_limit=1 << 26
    ):
        self.root, self.name, self.columns, self.buckets = root, name, columns, tuple(buckets)
        self.compression, self.size_limit = compression, size_limit
        self.writers: dict[str, MDSWriter] = {}
        self.counts: Counter = Counter()

    def folder(self, bucket: str) -> Path:
        return self.root / bucket / self.name if bucket else self.root / self.name

    def write(self, row: dict, bucket: str | None = None) -> None:
        """Write `row` into `bucket` ("" for none), by default the one its width and height fall in."""
        if bucket is None:
            bucket = bucket_name(row["width"], row["height"], self.buckets)
        writer = self.writers.get(bucket)
        if writer is None:
            folder = self.folder(bucket)
            shutil.rmtree(folder, ignore_errors=True)  # leftovers of an interrupted earlier attempt
            writer = self.writers[bucket] = MDSWriter(
                out=str(folder),
                columns=self.columns,
                compression=self.compression,
                size_limit=self.size_limit,
            )
        writer.write(row)
        self.counts[bucket] += 1

    def close(self) -> dict[str, dict]:
        indexes = {}
        for bucket, writer in self.writers.items():
            writer.finish()
            index = json.loads((self.folder(bucket) / "index.json").read_text())
            indexes[bucket] = {"rows": self.counts[bucket], "index": index}
        self.writers.clear()
        return indexes

    def abort(self) -> None:
        for writer in self.writers.values():
            writer.cancel_future_jobs()
        self.writers.clear()
