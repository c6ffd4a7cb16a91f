"""Clear streaming shared memory that a killed run left behind for this run's data folders.

A StreamingDataset registers its local folders in shared memory (`/dev/shm/NNNNNN_locals` plus
five companion blocks) and a lock file per prefix in the temp folder. SIGKILL skips the
unregistering, and streaming 0.13's `clean_stale_shared_memory` walks prefixes from 0 and stops at
the first one without shared memory, so leftovers behind a free prefix stay forever. While the lock
files survive, later runs merely step over the leftover prefix; once they are gone (a temp-folder
cleaner, a new container with the host's /dev/shm) streaming refuses the folder with "Reused local
directory". This module handles both: every prefix whose registered folders overlap ours is removed.

Streaming's own `clean_stale_shared_memory` is not run: it unlinks every prefix from 0 up to the
first free one, whether its job is dead or alive, so a run starting beside another job on the same
host took that job's registration away; the next dataset then reused its prefix and collided with
its blocks (`FileExistsError: /000523_epoch_shape`, seen with two test workers). A killed run's
leftovers on other folders do not block ours: streaming steps over a prefix in use.

A prefix some live job holds (its owner file's flock, data/streaming_base.py) is not a killed run's
and stays: streaming lets jobs on one host share a local-only folder (no remote; a sweep of
single-GPU runs over one /data/mds, or two test workers), and removing a live job's registration
took its barrier and resume position away (`FileNotFoundError: /000922_barrier`, seen in the
suite). Whether some process maps a prefix's blocks proves nothing: processes that merely probed a
prefix keep them mapped. A registration without an owner file (streaming used alone) is treated as
before, as a killed run's.

Run before this job's datasets exist, on each host's local rank 0, with the other ranks waiting.
"""

import logging
import os
from pathlib import Path
from tempfile import gettempdir

from composer.utils import dist

from compat.streaming import (
    BARRIER_FILELOCK,
    CACHE_FILELOCK,
    LOCALS,
    SHM_TO_CLEAN,
    registered_locals,
    shm_path,
)
from data.streaming_base import OWNER_FILE, host_lock, prefix_held

log = logging.getLogger(__name__)
SHM_DIR = Path("/dev/shm")  # where POSIX shared memory lives on Linux


def _registered_locals(locals_block: Path) -> list[str]:
    try:
        return registered_locals(locals_block.read_bytes())
    except (OSError, ValueError, UnicodeDecodeError):  # vanished meanwhile, or not streaming's
        return []


def remove_registrations(stale) -> list[int]:
    """Remove every streaming prefix for which `stale(registered_folders)` is true and that no live
    job holds (data/streaming_base.py `prefix_held`); returns them. Under the host-wide registration
    lock, so no job registers meanwhile."""
    removed = []
    with host_lock():
        for block in sorted(SHM_DIR.glob(f"*_{LOCALS}")):
            prefix = block.name.split("_", 1)[0]
            if not prefix.isdigit() or not stale([os.path.abspath(f) for f in _registered_locals(block)]):
                continue
            prefix_int = int(prefix)
            if prefix_held(prefix_int):  # a live job's: it shares the folder
                continue
            for name in SHM_TO_CLEAN:
                (SHM_DIR / shm_path(prefix_int, name).lstrip("/")).unlink(missing_ok=True)
            for name in (BARRIER_FILELOCK, CACHE_FILELOCK):
                Path(gettempdir(), shm_path(prefix_int, name)).unlink(missing_ok=True)
            Path(OWNER_FILE.format(prefix_int)).unlink(missing_ok=True)
            removed.append(prefix_int)
    return removed


def remove_stale_registrations(folders: list[str]) -> list[int]:
    """Remove every dead streaming prefix that registers one of `folders`; returns those removed."""
    ours = {os.path.abspath(f) for f in folders}
    removed = remove_registrations(lambda registered: bool(ours & set(registered)))
    if removed:
        log.info("removed a killed run's streaming shared memory for %s (prefixes %s)", folders, removed)
    return removed


def clean_shared_memory(folders: list[str]) -> None:
    """Remove a killed run's registrations of `folders`, on local rank 0 while other ranks wait
    (call it with the process group already up: composer's `dist.initialize_dist`)."""
    if dist.get_local_rank() == 0 and SHM_DIR.is_dir():
        remove_stale_registrations(folders)
    dist.barrier()
