"""Write a file or folder under a temporary name beside its final one, then rename it into place.

A reader, or a run restarted after a kill, then finds the old content or the new, never half of
either: a rename within one filesystem is atomic on POSIX, which is why the temporary path is a
sibling (same folder) and not under /tmp. Lives in `convert`, the lowest layer that writes files, so
that convert, recipes and demo can all use it (tests/test_layers.py enforces the order).
"""

import contextlib
import logging
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Literal

log = logging.getLogger(__name__)

Existing = Literal["replace", "swap", "keep"]


def temporary_sibling(final: str | Path, tag: str = "tmp") -> Path:
    """`.tmp-{pid}-{name}` beside `final`. The pid keeps concurrent writers (ranks) apart; the name
    keeps `final`'s suffix, from which composer picks a checkpoint's format; the dot hides it."""
    final = Path(final)
    return final.with_name(f".{tag}-{os.getpid()}-{final.name}")


def remove(path: Path) -> None:
    """Delete a file, a symlink (not its target) or a folder tree; nothing there is fine."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


@contextlib.contextmanager
def atomic_path(final: str | Path, existing: Existing = "replace") -> Iterator[Path]:
    """Yield a temporary sibling path for the block to write (a file, symlink or folder); rename it
    onto `final` when the block succeeds, remove it when the block raises (or the rename fails).

    `existing` says what happens when `final` is already there:
      - "replace": os.replace. A file, a symlink or an empty folder is replaced; a non-empty folder
        makes the rename fail (OSError) and stays as it was.
      - "swap": the old `final` is renamed aside, the new one in, then the old one deleted. A kill
        between the two renames leaves no `final` (so nothing half-written looks finished).
      - "keep": writers that race to make the same content (ranks preparing one dataset): if the
        rename fails because `final` has appeared meanwhile, that one is kept and this one dropped.
        Whether the kept `final` is complete is for the caller to check.
    """
    final = Path(final)
    tmp = temporary_sibling(final)
    remove(tmp)  # left by an earlier process that had the same pid and was killed
    final.parent.mkdir(parents=True, exist_ok=True)
    try:
        yield tmp
        _publish(tmp, final, existing)
    finally:
        remove(tmp)


def _publish(tmp: Path, final: Path, existing: Existing) -> None:
    if existing == "swap" and (final.exists() or final.is_symlink()):
        old = temporary_sibling(final, "old")
        remove(old)
        os.replace(final, old)
        os.replace(tmp, final)
        remove(old)
        return
    try:
        os.replace(tmp, final)
    except OSError:
        if existing != "keep" or not final.exists():
            raise
        log.info("%s was made meanwhile by another process; keeping that one", final)


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    """Write `data` to `path` atomically (see atomic_path)."""
    with atomic_path(path) as tmp:
        tmp.write_bytes(data)
