"""Crash-safe checkpoint files.

Composer 0.32 writes a local checkpoint straight to its final name. A run killed mid-write leaves
a truncated `ep*-ba*-rank*.pt`: the `latest` symlink still points at the previous checkpoint, so
autoresume is unaffected, but the resumed run then fails when it saves that batch again (the file
exists) or, with save_overwrite, a user may load the torn file by name. Writing to a temporary
name in the same folder and renaming it into place (atomic on POSIX) means a checkpoint file
either is complete or does not exist.
"""

import functools
import logging

from common.atomic import atomic_path
from compat.composer import checkpoint_file_writer, set_checkpoint_file_writer

log = logging.getLogger(__name__)


def install_atomic_checkpoint_writes() -> None:
    """Make composer's checkpoint file writes atomic (idempotent)."""
    original = checkpoint_file_writer()
    if getattr(original, "_atomic", False):
        return

    @functools.wraps(original)
    def write_atomically(state_dict, filename: str) -> None:
        # The temporary name keeps the final one's suffix, from which composer picks tar/compressed
        # formats; a kill mid-write leaves only that `.tmp-PID-NAME`, which nothing loads.
        with atomic_path(filename) as tmp:
            original(state_dict, str(tmp))

    write_atomically._atomic = True
    set_checkpoint_file_writer(write_atomically)
