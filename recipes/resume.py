"""Where a rerun resumes from when `trainer.save_folder` is in object storage (`s3://...`).

Composer 0.32.1's autoresume does not fit a remote folder:
- it downloads the remote `latest-rank0.pt` pointer's checkpoint to `os.path.join(save_folder, ...)`,
  which for `s3://bucket/prefix` is `./s3:/bucket/prefix/latest-rank0.pt` in the working directory
  (a 12-15 GB file for sd2-base), and on every later restart prefers that local file to the bucket:
  measured with the tiny recipe, the third run of a job resumed from the first restart's batch 40
  although the bucket held batch 140, and every further restart would go back there again;
- the pointer is uploaded 30-40 s after the checkpoint it names (Composer polls for the upload), so a
  kill in that window resumes one save interval back although the newer checkpoint is in the bucket.

So for a remote folder our runs do not use Composer's autoresume: rank 0 lists the folder, takes the
checkpoint with the most batches (an S3 object is listed only once its upload has completed, so a
listed checkpoint is whole) and every rank loads it by URI, which Composer downloads into a temporary
folder. Nothing is written outside the configured folders and no local file is consulted. Sharded
checkpoints (a folder of files per checkpoint, `state_dict_type: sharded`) keep Composer's own path,
which reads the remote pointer directly.
"""

import logging
import re
import string

from composer.utils import dist, format_name_with_dist, maybe_create_object_store_from_uri, parse_uri

log = logging.getLogger(__name__)

SAVE_FILENAME = "ep{epoch}-ba{batch}-rank{rank}.pt"  # composer.Trainer's default save_filename
# Fields of a save_filename that hold the rank-0 file's values; any other field is a number or a time.
RANK_ZERO = {"rank": "0", "local_rank": "0", "node_rank": "0"}


def is_remote(folder: str | None) -> bool:
    return folder is not None and parse_uri(str(folder))[0] != ""


def checkpoint_pattern(save_filename: str, run_name: str) -> re.Pattern | None:
    """A regex for rank 0's checkpoint names under `save_filename`, its batch count in group `batch`;
    None when the name holds no `{batch}` (checkpoints could not be ordered)."""
    parts, has_batch = [], False
    for literal, field, _, _ in string.Formatter().parse(save_filename):
        parts.append(re.escape(literal))
        if field is None:
            continue
        if field == "batch" and not has_batch:
            parts.append(r"(?P<batch>\d+)")
            has_batch = True
        elif field == "run_name":
            parts.append(re.escape(run_name))
        elif field in RANK_ZERO:
            parts.append(RANK_ZERO[field])
        else:
            parts.append(r"[^/]+?")
    return re.compile("".join(parts) + r"\Z") if has_batch else None


def newest_checkpoint(save_folder: str, save_filename: str, run_name: str) -> str | None:
    """The URI of the checkpoint in `save_folder` with the most batches, None when it holds none."""
    pattern = checkpoint_pattern(save_filename, run_name)
    folder = format_name_with_dist(save_folder, run_name).rstrip("/")
    store = maybe_create_object_store_from_uri(folder)
    prefix = parse_uri(folder)[2].strip("/")
    prefix = f"{prefix}/" if prefix else ""
    found = {}
    for name in store.list_objects(prefix):
        if (match := pattern.match(name[len(prefix) :])) is not None:
            found[int(match["batch"])] = name
    return store.get_uri(found[max(found)]) if found else None


def remote_autoresume(trainer: dict, run_name: str) -> dict:
    """`trainer` (the composer.Trainer keyword arguments of a run) with Composer's autoresume replaced
    for a remote, non-sharded save_folder: `load_path` is the newest checkpoint there, loaded whole
    (what Composer's autoresume does with the checkpoint it finds), or the run's own `load_path` when
    the folder holds none. Anything else is returned unchanged."""
    folder = trainer.get("save_folder")
    sharded = (trainer.get("parallelism_config") or {}).get("fsdp", {}).get("state_dict_type") == "sharded"
    if not trainer.get("autoresume") or not is_remote(folder) or sharded:
        return trainer
    save_filename = trainer.get("save_filename", SAVE_FILENAME)
    if checkpoint_pattern(save_filename, run_name) is None:
        log.warning("save_filename=%r has no {batch}: autoresume left to Composer", save_filename)
        return trainer
    newest = [newest_checkpoint(folder, save_filename, run_name) if dist.get_global_rank() == 0 else None]
    dist.broadcast_object_list(newest, src=0)
    trainer = {**trainer, "autoresume": False}
    if newest[0] is None:
        log.info("autoresume: no checkpoint in %s yet; starting this run", folder)
        return trainer
    log.info("autoresume: resuming from %s, the newest checkpoint in %s", newest[0], folder)
    return {
        **trainer,
        "load_path": newest[0],
        "load_weights_only": False,
        "load_ignore_keys": None,
        "load_exclude_algorithms": None,
    }
