"""Which sharded checkpoints in a remote save_folder (`s3://...`) are complete.

Composer 0.32.1 uploads a sharded checkpoint object by object: each rank of the first model copy its
`ep{epoch}-ba{batch}/__{rank}_0.distcp`, rank 0 also the `.metadata` (composer/callbacks/
checkpoint_saver.py), each from its own upload threads. A run killed mid-upload leaves some of them,
and S3 lists an object only once it is whole; so a checkpoint counts when its `.metadata` is listed
and every file that metadata names is listed at least as long as the bytes it reads from it
(models/checkpoints/sharded_checkpoint.py): one download of the `.metadata` (kilobytes) and one size request
per file.
"""

import logging
import re
import tempfile
from pathlib import Path

from models.checkpoints.sharded_checkpoint import (
    METADATA,
    ShardedCheckpointError,
    read_metadata,
    shard_problem,
)

log = logging.getLogger(__name__)


def complete_remote_checkpoints(store, names: list[str], prefix: str, pattern: re.Pattern) -> dict[int, str]:
    """batch -> folder name (under `store`) of every complete sharded checkpoint among the object
    `names` listed under `prefix`; `pattern` matches a checkpoint folder's name relative to it."""
    folders = {}
    for name in names:
        folder, _, base = name[len(prefix) :].rpartition("/")
        if base == METADATA and (match := pattern.match(folder)) is not None:
            folders[int(match["batch"])] = f"{prefix}{folder}"
    complete = {}
    for batch, folder in sorted(folders.items(), reverse=True):
        problem = _problem(store, folder)
        if problem is None:
            complete[batch] = folder
            break  # the newest complete one is all a resume needs
        log.warning(
            "autoresume: skipping %s, an incomplete sharded checkpoint (%s)", store.get_uri(folder), problem
        )
    return complete


def _problem(store, folder: str) -> str | None:
    with tempfile.TemporaryDirectory(prefix="sharded-metadata-") as tmp:
        store.download_object(f"{folder}/{METADATA}", str(Path(tmp, METADATA)))
        try:
            metadata = read_metadata(tmp)
        except ShardedCheckpointError as error:
            return str(error)
    sizes = {}
    for name in {info.relative_path for info in metadata.storage_data.values()}:
        try:
            sizes[name] = store.get_object_size(f"{folder}/{name}")
        except FileNotFoundError:
            pass
    return shard_problem(metadata, sizes)
