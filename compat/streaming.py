"""mosaicml-streaming internals we rely on, written for mosaicml-streaming 0.13.0.

The package `streaming` exports the writers, Stream and StreamingDataset only; everything else
lives below `streaming.base`, which has no stability promise: a minor release may drop a name
(0.13 has no `streaming.base.storage.download_file`), so each one used is listed here and checked
by tests/test_compat.py.

Modules below the public package (re-exported here):
- `streaming.base.world.World`: which rank is its node's local leader (data/streaming_base.py's
  host-wide prefix lock is taken by that rank).
- `streaming.base.util`: `merge_index` (convert/report.py merges per-input indexes) and
  `bytes_to_int` (data/streams.py checks `cache_limit` as streaming will parse it).
- `streaming.base.shuffle.algos` as SHUFFLE_ALGOS: the valid `shuffle_algo` names, checked up front.
- `streaming.base.storage.CloudDownloader`: reads a remote index.json with streaming's own
  credentials and endpoint (data/streams.py).
- `streaming.base.compression.decompress`, `streaming.base.format.reader_from_json`: read one MDS
  shard outside a StreamingDataset (convert/latents_source.py).
- `streaming.base.constant`: the names of a prefix's shared-memory blocks and lock files.
- UPLOAD_LOGGER: the logger `merge_index` warns through, silenced by convert/report.py.

Private names (wrapped in functions below):
- `shared.prefix._get_path`, `_unpack_locals`: a prefix's block/lock file names and the folders a
  `*_locals` block registers, for recipes/shm.py's cleanup of a killed run's shared memory; a
  StreamingDataset's `_shm_prefix_int`, the prefix it registered (data/streaming_base.py holds it).
- `shared.prefix._check_and_find` and its module's `SharedMemory`: patched for the test session
  (`prefix_probes_close_after_use`) so the shared memory merely probed is closed at once.
- StreamingDataset's `_unique_rank_world`, `_parallel_rank_world`, `_unique_worker_world`,
  `_parallel_worker_world`, `_resume_incr_epoch()`, `_get_work(epoch, sample_in_epoch)`: the first
  steps of streaming's `__iter__`, which data/streaming_base.py repeats to iterate a local-only set
  without streaming's download threads (`epoch_sample_ids`).
- StreamingDataset's `_iterator` (with `.exit()`) and `_executor`: the threads of an epoch
  iterated the streaming way, stopped before the next epoch or when a test drops a dataset.
"""

import functools
from collections.abc import Iterator
from contextlib import contextmanager

from streaming.base.compression import decompress
from streaming.base.constant import BARRIER_FILELOCK, CACHE_FILELOCK, LOCALS, SHM_TO_CLEAN
from streaming.base.format import reader_from_json
from streaming.base.shared import prefix as _prefix
from streaming.base.shared.prefix import _get_path, _unpack_locals
from streaming.base.shuffle import algos as SHUFFLE_ALGOS
from streaming.base.storage import CloudDownloader
from streaming.base.util import bytes_to_int, merge_index
from streaming.base.world import World

UPLOAD_LOGGER = "streaming.base.storage.upload"

__all__ = [
    "BARRIER_FILELOCK",
    "CACHE_FILELOCK",
    "LOCALS",
    "SHM_TO_CLEAN",
    "SHUFFLE_ALGOS",
    "UPLOAD_LOGGER",
    "CloudDownloader",
    "World",
    "bytes_to_int",
    "decompress",
    "epoch_sample_ids",
    "has_epoch_threads",
    "merge_index",
    "prefix_probes_close_after_use",
    "reader_from_json",
    "registered_locals",
    "shm_path",
    "shm_prefix",
    "stop_epoch_threads",
]


def shm_path(prefix_int: int, name: str) -> str:
    """The name of prefix `prefix_int`'s shared-memory block or lock file `name` ("/000003_locals")."""
    return _get_path(prefix_int, name)


def shm_prefix(dataset) -> int:
    """The shared-memory prefix a StreamingDataset registered its folders under."""
    return dataset._shm_prefix_int


def registered_locals(data: bytes) -> list[str]:
    """The local folders a `*_locals` shared-memory block registers (its bytes); ValueError or
    UnicodeDecodeError if they are not streaming's."""
    folders, _ = _unpack_locals(data)
    return folders


def has_epoch_threads(dataset) -> bool:
    """Whether `dataset` iterated an epoch with streaming's download threads in this process."""
    return hasattr(dataset, "_iterator")


def stop_epoch_threads(dataset, wait: bool = False) -> None:
    """Stop the threads of an epoch `dataset` iterated the streaming way (nothing if none); with
    `wait`, also shut down its thread pool and wait for it."""
    if hasattr(dataset, "_iterator"):
        dataset._iterator.exit()
        if wait:
            dataset._executor.shutdown(wait=True)


def epoch_sample_ids(dataset):
    """This worker's sample ids for the epoch `iter(dataset)` starts, as streaming 0.13's `__iter__`
    computes them before it starts its threads: resume state or the next epoch, then the partition
    (-1 pads a short one). Advances the dataset's epoch as that `__iter__` does."""
    dataset._unique_worker_world = dataset._unique_rank_world.detect_workers()
    dataset._parallel_worker_world = dataset._parallel_rank_world.detect_workers()
    epoch, sample_in_epoch = dataset._resume_incr_epoch()
    return dataset._get_work(epoch, sample_in_epoch)


@contextmanager
def prefix_probes_close_after_use() -> Iterator[None]:
    """Within this, a new StreamingDataset closes the shared memory it merely probes for a free
    prefix as soon as the probe is done, instead of holding its file descriptor (through an atexit
    hook) until the process exits: 6 per prefix in use per dataset built, which a process building
    a hundred datasets (a test worker) runs out of."""
    check, shared_memory = _prefix._check_and_find, _prefix.SharedMemory

    def check_closing_probes(*args, **kwargs):
        _prefix.SharedMemory = functools.partial(shared_memory, auto_cleanup=False)
        try:
            return check(*args, **kwargs)
        finally:
            _prefix.SharedMemory = shared_memory

    _prefix._check_and_find = check_closing_probes
    try:
        yield
    finally:
        _prefix._check_and_find = check
