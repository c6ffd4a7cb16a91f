"""Run a conversion: inputs -> one MDS sub-dataset each (in worker processes) -> merged index + report.

Restartable by construction: input NAME becomes `<out>/[<bucket>/]NAME/` and, once completely written
(and uploaded), a completion marker `<out>/_done/NAME.json`. A rerun skips inputs that have a marker
and clears and rewrites any that do not, so a run killed at any moment leaves nothing a rerun can
double. The top-level index.json (and one per bucket) is merged at the end from the markers only, so
it never names a shard of an unfinished input.

What a run writes per input is `Job.write_rows` (images: `write_images`; latents: convert.latents),
and it runs as one process, `workers` forked ones, or the ranks of a launcher (`composer -n N`,
torchrun: a `Group`), each rank converting its share of the inputs, rank 0 merging.
"""

import contextlib
import ctypes
import hashlib
import json
import logging
import multiprocessing as mp
import os
import signal
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from convert.common import ConvertError, Part, Skipped
from convert.identity import MARKERS, REPORT, claim, record
from convert.mds import PartWriter
from convert.ranks import Group, share
from convert.report import build_report, merge_indexes
from convert.samples import Options, bucket_label, prepare
from convert.storage import LocalStore, S3Store, open_store

log = logging.getLogger(__name__)


def write_images(part: Part, job: "Job", writer: PartWriter, progress=None) -> tuple[Counter, Counter]:
    """The image converters' rows: each raw sample checked and prepared (convert.samples), bucketed
    by its size. Returns the skipped and repaired counts by reason."""
    skipped, repaired, pending = Counter(), Counter(), 0
    for raw in part.samples():
        result = raw if isinstance(raw, Skipped) else prepare(raw, job.options, job.columns)
        if isinstance(result, Skipped):
            skipped[result.reason] += 1
            log.debug("%s: skipped %s: %s", part.name, result.key, result.reason)
        else:
            writer.write(result[0])
            for reason in result[1]:
                repaired[reason] += 1
        pending += 1
        if progress is not None and pending == 64:
            progress(pending)
            pending = 0
    if progress is not None and pending:
        progress(pending)
    return skipped, repaired


@dataclass(frozen=True)
class Job:
    """What every worker needs; plain data so it crosses into worker processes."""

    store: LocalStore | S3Store
    columns: dict
    options: Options  # or any frozen dataclass with `buckets`, `compression`, `shard_size_limit`, `digest`
    digest: str
    work_dir: Path
    # (part, job, writer, progress) -> (skipped, repaired): writes one input's rows into the PartWriter
    write_rows: Callable = write_images

    def bucket_folders(self, name: str) -> list[str]:
        buckets = self.options.buckets
        return [f"{bucket_label(b)}/{name}" for b in buckets] if buckets else [name]


def default_work_dir(out: str) -> Path:
    """Same place for the same --out on every run, so a rerun finds its downloads and staging."""
    return Path(tempfile.gettempdir()) / f"sd-convert-{hashlib.sha1(out.encode()).hexdigest()[:12]}"


def convert_part(part: Part, job: Job, progress=None) -> dict:
    """Write one input's sub-dataset(s), publish them, then its completion marker (returned)."""
    for folder in job.bucket_folders(part.name):
        job.store.clear(folder)  # whatever an interrupted earlier attempt left behind
    opts = job.options
    writer = PartWriter(
        job.store.staging("", job.work_dir),
        part.name,
        job.columns,
        opts.buckets,
        opts.compression,
        opts.shard_size_limit,
    )
    try:
        skipped, repaired = job.write_rows(part, job, writer, progress)
        indexes = writer.close()
    except BaseException:
        writer.abort()
        raise
    for bucket in indexes:
        job.store.publish(writer.folder(bucket), f"{bucket}/{part.name}" if bucket else part.name)
    marker = {
        "input": part.name,
        "options": job.digest,
        "samples_written": sum(entry["rows"] for entry in indexes.values()),
        "samples_skipped": dict(skipped),
        "samples_repaired": dict(repaired),
        "buckets": indexes,
    }
    job.store.write_bytes(f"{MARKERS}/{part.name}.json", json.dumps(marker).encode())
    return marker


def _attempt(part: Part, job: Job, progress) -> tuple[str, dict | None, str | None]:
    """(name, marker, None), or (name, None, error) for an input that failed in a way nobody foresaw:
    the other inputs go on, and having no marker, this one is retried by the next run."""
    try:
        return part.name, convert_part(part, job, progress), None
    except ConvertError:
        raise
    except Exception as err:
        log.debug("input %s failed", part.name, exc_info=True)
        return part.name, None, f"{type(err).__name__}: {err}"


_WORKER: dict = {}


def worker_slot() -> int:
    """0, 1, ... for the pool's worker processes (in start order), 0 outside a pool: what a job
    that needs a device per process (convert.latents) picks its GPU by."""
    return _WORKER.get("slot", 0)


def _init_worker(job: Job, counter, slots, parent: int) -> None:
    # Die with the parent: a killed conversion must not leave workers writing into folders that the
    # rerun is about to clear (Linux only; elsewhere they finish their current input and exit).
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    # A parent that died between the fork and the prctl sends no signal: this worker was already
    # adopted by another process, and would wait for work that never comes.
    if os.getppid() != parent:
        os._exit(1)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    # Pool.terminate() ends workers with SIGTERM. A handler inherited from the parent (importing
    # Composer installs one that raises SystemExit) would run the parent's copied multiprocessing
    # finalizers instead of dying, and one of them can wait forever on a thread that did not survive
    # the fork, and the conversion hangs at its end (in a process that imported Composer).
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    with slots.get_lock():
        slot, slots.value = slots.value, slots.value + 1
    _WORKER.update(job=job, counter=counter, slot=slot)


def _worker_progress(n: int) -> None:
    counter = _WORKER["counter"]
    with counter.get_lock():
        counter.value += n


def _run_in_worker(part: Part):
    return _attempt(part, _WORKER["job"], _worker_progress)


def _forked_pool(ctx, processes: int, init: tuple):
    """The worker pool, forked with SIGTERM at its default: a worker that Pool.terminate() reaches
    before _init_worker has reset it would otherwise run the parent's handler (see there). A conversion
    hung once in Pool.terminate's join of a worker (tests/test_convert_sources.py::test_folder in a
    full run of the suite on a loaded machine, torch 2.14); this closes that window."""
    main = threading.current_thread() is threading.main_thread()  # signal.signal works there only
    previous = signal.signal(signal.SIGTERM, signal.SIG_DFL) if main else None
    try:
        return ctx.Pool(processes, initializer=_init_worker, initargs=init)
    finally:
        if main:
            signal.signal(signal.SIGTERM, previous)


def run_parts(todo: list[Part], job: Job, workers: int, bar: tqdm) -> Iterator[tuple]:
    if workers <= 1 or len(todo) <= 1:
        for part in todo:
            yield _attempt(part, job, bar.update)
        return
    # fork: workers start in milliseconds, where spawn would re-import torch (via streaming) in each
    ctx = mp.get_context("fork")
    counter, slots, shown = ctx.Value("q", 0), ctx.Value("i", 0), 0
    init = (job, counter, slots, os.getpid())
    with _forked_pool(ctx, min(workers, len(todo)), init) as pool:
        results = pool.imap_unordered(_run_in_worker, todo)
        while True:
            try:
                result = results.next(timeout=0.2)
            except mp.TimeoutError:
                result = None
            except StopIteration:
                break
            finally:
                bar.update(counter.value - shown)
                shown = counter.value
            if result is not None:
                yield result


def read_markers(store, names: list[str]) -> dict[str, dict]:
    present = set(store.list_names(MARKERS, ".json")) & set(names)
    if isinstance(store, LocalStore):
        return {n: store.read_json(f"{MARKERS}/{n}.json") for n in present}
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(16) as pool:  # one small GET each: overlap the round trips
        return dict(zip(present, pool.map(lambda n: store.read_json(f"{MARKERS}/{n}.json"), present)))


def _plan(store, names: list[str], digest: str) -> dict[str, dict]:
    """The markers of inputs already done; an error if one was converted with other options (an
    output written before convert.identity's record, which --overwrite has cleared by now)."""
    markers = read_markers(store, names)
    other = sorted(n for n, m in markers.items() if m.get("options") != digest)
    if other:
        raise ConvertError(
            f"--out {store.url}: input {other[0]} (and {len(other) - 1} more) was converted with other "
            "options; rerun with the same options, use a new --out, or pass --overwrite"
        )
    return {n: markers[n] for n in names if n in markers}


def convert(
    parts: list[Part],
    out: str,
    options: Options,
    columns: dict,
    *,
    source: str = "",
    src: str = "",
    settings: dict | None = None,
    workers: int = 1,
    work_dir: str | Path | None = None,
    progress: bool = True,
    overwrite: bool = False,
    write_rows: Callable = write_images,
    group: Group | None = None,
) -> dict:
    """Convert every input not yet done, merge the index, write and return the report.

    `source`, `src`, `settings` (source options that change the output) and `options` identify the
    conversion (convert.identity): a rerun continues only the same one; `overwrite` first deletes
    whatever conversion the output holds.

    Under a `group` of several ranks each converts its share (`share`) with `workers` processes;
    rank 0 alone checks the output, holds its lock, reads the markers, merges and writes the report,
    and every rank returns the report (or raises the first rank's fatal error)."""
    group = group or Group()
    names = [p.name for p in parts]
    if len(set(names)) != len(names):
        raise ConvertError(
            f"--src {src}: two inputs map to the same name {Counter(names).most_common(1)[0][0]}"
        )
    store = open_store(out)
    digest = options.digest(columns)
    job = Job(store, columns, options, digest, Path(work_dir or default_work_dir(out)), write_rows)
    started = time.monotonic()
    with contextlib.ExitStack() as held:
        identity = record(source, src, settings or {}, options, columns, digest, names)
        done = _claim(group, store, held, identity, names, digest, overwrite)
        todo = [p for p in parts if p.name not in done]
        mine = share(todo, group.rank, group.world)
        log.info(
            "%d inputs, %d already done, %d to convert%s -> %s", len(parts), len(done), len(todo),
            f" ({len(mine)} by rank {group.rank} of {group.world})" if group.world > 1 else "", store.url,
        )  # fmt: skip
        failed, this_run, fatal = _convert_inputs(mine, job, workers, progress)
        results = group.gather((failed, this_run, None if fatal is None else str(fatal)))
        failed = {name: error for ranks_failed, _, _ in results for name, error in ranks_failed.items()}
        this_run = [marker for _, ranks_markers, _ in results for marker in ranks_markers]
        errors = [error for _, _, error in results if error is not None]
        done.update((marker["input"], marker) for marker in this_run)

        def report(error=None) -> dict:
            args = (source, src, store.url, options, parts, done, failed, this_run)
            return build_report(*args, time.monotonic() - started, error=error)

        final = _finish(group, store, job, [done[n] for n in names if n in done], errors, report)
    if fatal is not None:
        raise fatal
    if errors or isinstance(final, str):
        raise ConvertError(errors[0] if errors else final)
    _prune_empty(job.work_dir)
    return final


def _claim(group: Group, store, held, identity: dict, names: list[str], digest: str, overwrite: bool) -> dict:
    """Rank 0 checks the output, takes its lock (held until `held` closes), claims it for this
    conversion and reads which inputs are done; every rank gets those markers (or rank 0's error)."""
    plan: dict | str | None = None
    if group.rank == 0:
        try:
            store.check()
            held.enter_context(store.lock())
            claim(store, identity, overwrite)
            plan = _plan(store, names, digest)
        except ConvertError as err:
            if group.world == 1:
                raise
            plan = str(err)
    plan = group.broadcast(plan)
    if isinstance(plan, str):
        raise ConvertError(plan)
    return plan


def _convert_inputs(mine: list[Part], job: Job, workers: int, progress: bool):
    """(failed {input: error}, markers written, a fatal ConvertError or None) of this rank's inputs,
    with a progress bar over their samples."""
    sizes = [p.size for p in mine]
    total = sum(sizes) if None not in sizes else None
    failed, this_run, fatal = {}, [], None
    bar = tqdm(total=total, unit="sample", desc="convert", disable=not progress, smoothing=0.1)
    try:
        for name, marker, error in run_parts(mine, job, workers, bar):
            if error is not None:
                failed[name] = error
                log.warning("input %s failed and will be retried by the next run: %s", name, error)
            else:
                this_run.append(marker)
    except ConvertError as err:
        fatal = err
    finally:
        bar.close()
    return failed, this_run, fatal


def _finish(
    group: Group, store, job: Job, markers: list[dict], errors: list[str], report
) -> dict | str | None:
    """Rank 0 merges the index of the done inputs and writes the report (only the report, best
    effort, when a rank failed); every rank gets the report, or rank 0's error as a string."""
    final: dict | str | None = None
    if group.rank == 0:
        try:
            if errors:
                try:  # best effort: the store may be what failed
                    store.write_bytes(REPORT, json.dumps(report(errors[0]), indent=2).encode())
                except ConvertError:
                    pass
            else:
                merge_indexes(store, markers, job.work_dir)
                final = report()
                store.write_bytes(REPORT, json.dumps(final, indent=2).encode())
        except ConvertError as err:
            if group.world == 1:
                raise
            final = str(err)
    return group.broadcast(final)


def _prune_empty(folder: Path) -> None:
    """Remove the work dir's empty folders (all of it when nothing is left, e.g. no downloads)."""
    try:
        paths = sorted(folder.rglob("*"), key=lambda p: len(p.parts), reverse=True) + [folder]
    except OSError:  # gone, or going: another rank pruned it
        return
    for path in paths:
        try:
            if path.is_dir() and not any(path.iterdir()):
                path.rmdir()
        except OSError:  # another rank pruned it first, or wrote into it meanwhile
            pass
