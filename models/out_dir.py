"""An export's output folder (models.export): new or empty, never merged into, and written beside its
final name and renamed into place when complete, so a failed or killed export leaves no OUT_DIR."""

import contextlib
import errno
from pathlib import Path

from common.atomic import atomic_path


def check_out_dir(out_dir: str | Path) -> Path:
    """`out_dir` is new or an empty folder: an export never merges into, or replaces, what is there
    (FileExistsError, one line, otherwise)."""
    out_dir = Path(out_dir)
    if out_dir.is_symlink():  # the rename would replace the link, not fill the folder it names
        raise FileExistsError(f"{out_dir} is a symbolic link: give a new or empty folder to export into")
    if out_dir.exists() and not out_dir.is_dir():
        raise FileExistsError(f"{out_dir} is a file, not a folder: give a new or empty folder to export into")
    if out_dir.is_dir():
        held = sorted(p.name for p in out_dir.iterdir())
        if held:
            shown = ", ".join(held[:3]) + (f" and {len(held) - 3} more" if len(held) > 3 else "")
            raise FileExistsError(
                f"{out_dir} is not empty (it holds {shown}): export into a new or empty folder; "
                "nothing there was changed"
            )
    return out_dir


class WriteError(OSError):
    """Writing the export failed (the message is one line; nothing is left at OUT_DIR)."""


@contextlib.contextmanager
def written_into_place(out_dir: Path):
    """A temporary sibling of `out_dir` to write, renamed onto it when complete (common.atomic)."""
    check_out_dir(out_dir)
    try:
        with atomic_path(out_dir, existing="replace") as tmp:
            yield tmp
    except OSError as error:
        if error.errno in (errno.ENOTEMPTY, errno.EEXIST):  # the rename: the folder was filled meanwhile
            raise FileExistsError(
                f"{out_dir} was filled by something else during the export: nothing was written to it; "
                "export into a new or empty folder"
            ) from error
        # A full disk, a permission: one line, and (atomic_path removed the partial copy) no OUT_DIR.
        raise WriteError(f"writing {out_dir}: {error}; nothing was written there") from error
