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

Run before this job's datasets exist, on each host's local rank 0, with the other ranks waiting.
A second live job on the same host using the same data folder would lose its registration; streaming
does not support that setup anyway.
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

log = logging.getLogger(__name__)
SHM_DIR = Path("/dev/shm")  # where POSIX shared memory lives on Linux


def _registered_locals(locals_block: Path) -> list[str]:
    try:
        return registered_locals(locals_block.read_bytes())
    except (OSError, ValueError, UnicodeDecodeError):  # vanished meanwhile, or not streaming's
        return []


def remove_registrations(stale) -> list[int]:
    """Remove every streaming prefix for which `stale(registered_folders)` is true; returns them."""
    removed = []
    for block in sorted(SHM_DIR.glob(f"*_{LOCALS}")):
        prefix = block.name.split("_", 1)[0]
        if not prefix.isdigit() or not stale([os.path.abspath(f) for f in _registered_locals(block)]):
            continue
        prefix_int = int(prefix)
        for name in SHM_TO_CLEAN:
            (SHM_DIR / shm_path(prefix_int, name).lstrip("/")).unlink(missing_ok=True)
        for name in (BARRIER_FILELOCK, CACHE_FILELOCK):
            Path(gettempdir(), shm_path(prefix_int, name)).unlink(missing_ok=True)
        removed.append(prefix_int)
    return removed


def remove_stale_registrations(folders: list[str]) -> list[int]:
    """Remove every streaming prefix that registers one of `folders`; returns the prefixes removed."""
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
