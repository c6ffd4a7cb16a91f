"""Where a rerun resumes from (`trainer.autoresume`): one decision, made on rank 0 and broadcast, for a
`trainer.save_folder` in object storage (`s3://...`) or on a local (shared) disk.

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
listed checkpoint file is whole) and every rank loads it by URI, which Composer downloads into a
temporary folder. Nothing is written outside the configured folders and no local file is consulted.

Sharded checkpoints (FSDP2, recipes/parallelism.py: a folder `ep{epoch}-ba{batch}/` per checkpoint,
a file per rank and a `.metadata`, uploaded object by object) count only when complete: the
`.metadata` is there and every file it names is, at least as long as the bytes it reads from it
(models/checkpoints/sharded_checkpoint.py). A folder some rank's upload or write never finished is skipped, as
is a checkpoint file that does not load; the newest complete checkpoint of either kind is resumed.

A local folder is not left to Composer either (`local_autoresume`): its autoresume follows rank 0's
`latest-rank0.pt` symlink, which Composer replaces by deleting it and linking anew (a kill between
the two restarts the run at batch 0 over its own checkpoints) and which may name a file that does
not load (one torn by a crash before extensions/checkpointing.py made writes atomic, or damaged
since). Instead rank 0 lists the folder, every rank says which of those files it sees whole (same
size: a save_folder that some node does not share shows up here), and rank 0 takes the newest that
every rank sees and that loads (models/checkpoints/checkpoint_file.py), then broadcasts that one decision. A
newer file that does not load is skipped with a warning naming it, and renamed aside
(`NAME.unreadable`, never deleted): under its own name Composer would refuse to start
(save_overwrite=false, a "conflicting" newer checkpoint) or the run would save over it.
"""

import logging
import os
import re
import string
from pathlib import Path

from composer.utils import dist, format_name_with_dist, maybe_create_object_store_from_uri, parse_uri

from common.atomic import atomic_path
from models.checkpoints.checkpoint_file import CheckpointError, read_checkpoint
from models.checkpoints.sharded_checkpoint import (
    METADATA,
    ShardedCheckpointError,
    check_complete,
    is_sharded_checkpoint,
)
from recipes.remote_sharded import complete_remote_checkpoints

log = logging.getLogger(__name__)


class ResumeError(ValueError):
    """Checkpoints are there but none can be resumed; one line that says why and what to do
    (build_trainer reports it as a config error: recipes/load_check.py)."""


SAVE_FILENAME = "ep{epoch}-ba{batch}-rank{rank}.pt"  # composer.Trainer's default save_filename
# What extensions.callbacks.NaNGuard saves the last good state as, beside the interval checkpoints.
LAST_GOOD = "last-good-ba{batch}-rank{rank}.pt"
# Composer's folder for a sharded checkpoint, beside save_filename (FSDP2Config.sharded_ckpt_prefix_dir,
# fixed in Composer 0.32.1; composer/utils/checkpoint.py get_save_filename).
SHARDED_FOLDER = "ep{epoch}-ba{batch}"
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


def sharded_pattern(save_filename: str, run_name: str) -> re.Pattern:
    """A regex for the folders of sharded checkpoints under `save_filename`, relative to save_folder."""
    parent = os.path.dirname(save_filename)
    return checkpoint_pattern(f"{parent}/{SHARDED_FOLDER}" if parent else SHARDED_FOLDER, run_name)


def newest_checkpoint(save_folder: str, save_filename: str, run_name: str) -> str | None:
    """The URI of the checkpoint in `save_folder` with the most batches, None when it holds none: a
    checkpoint file, or the folder of a complete sharded checkpoint."""
    pattern = checkpoint_pattern(save_filename, run_name)
    folder = format_name_with_dist(save_folder, run_name).rstrip("/")
    store = maybe_create_object_store_from_uri(folder)
    prefix = parse_uri(folder)[2].strip("/")
    prefix = f"{prefix}/" if prefix else ""
    names = store.list_objects(prefix)
    found = {}
    for name in names:
        if (match := pattern.match(name[len(prefix) :])) is not None:
            found[int(match["batch"])] = name
    found.update(complete_remote_checkpoints(store, names, prefix, sharded_pattern(save_filename, run_name)))
    return store.get_uri(found[max(found)]) if found else None


def loads_sharded(load_path: str | None) -> bool:
    """Whether `load_path` is a sharded checkpoint (a folder; remote: a name without a file suffix, as
    Composer's `ep{epoch}-ba{batch}` folders have and its checkpoint files do not)."""
    if not load_path:
        return False
    if is_remote(load_path):
        return not Path(parse_uri(load_path)[2].rstrip("/")).suffix
    return is_sharded_checkpoint(load_path)


def autoresume(trainer: dict, run_name: str) -> dict:
    """`trainer` (composer.Trainer's keyword arguments) with the checkpoint a rerun resumes from as its
    `load_path` and Composer's autoresume off, for a remote or a local save_folder; unchanged when
    the run does not autoresume."""
    return local_autoresume(remote_autoresume(trainer, run_name), run_name)


def _resume_from(trainer: dict, path: str) -> dict:
    """What Composer's autoresume does with the checkpoint it finds: load it whole, whatever the run's
    own load options (those are for a first run's `load_path`)."""
    return {
        **trainer,
        "autoresume": False,
        "load_path": path,
        "load_weights_only": False,
        "load_ignore_keys": None,
        "load_exclude_algorithms": None,
    }


def remote_autoresume(trainer: dict, run_name: str) -> dict:
    """`trainer` (the composer.Trainer keyword arguments of a run) with Composer's autoresume replaced
    for a remote, non-sharded save_folder: `load_path` is the newest checkpoint there, loaded whole
    (what Composer's autoresume does with the checkpoint it finds), or the run's own `load_path` when
    the folder holds none. Anything else is returned unchanged."""
    folder = trainer.get("save_folder")
    if not trainer.get("autoresume") or not is_remote(folder):
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
    return _resume_from(trainer, newest[0])


def on_rank_zero(work):
    """`work()` run on rank 0 and its result broadcast to every rank. When it raises, the other ranks
    raise too instead of waiting in the broadcast until the process group times out."""
    result = [None]
    if dist.get_global_rank() == 0:
        try:
            result = [("ok", work())]
        except BaseException as error:
            dist.broadcast_object_list([("failed", f"{type(error).__name__}: {error}")], src=0)
            raise
    dist.broadcast_object_list(result, src=0)
    status, value = result[0]
    if status == "failed":
        raise RuntimeError(f"rank 0 failed: {value}")
    return value


def local_checkpoints(folder: Path, *patterns: re.Pattern) -> list[tuple[int, str, int]]:
    """(batch, path, size) of every checkpoint under `folder` named by one of `patterns` (rank 0's
    files, a non-sharded checkpoint being rank 0's file alone, and sharded checkpoints' folders, their
    size the sum of their files'), newest first (by batch, then time). Temporary files of a write in
    progress or killed (`.tmp-PID-NAME`), symlinks (`latest`) and files renamed aside never match."""
    found = []
    for root, folders, names in os.walk(folder):
        for name in [*names, *folders]:
            path = Path(root, name)
            relative = path.relative_to(folder).as_posix()
            match = next((m for pattern in patterns if (m := pattern.match(relative))), None)
            if match is None or path.is_symlink():
                continue
            try:
                stat = path.stat()
                size = _size(str(path))
            except FileNotFoundError:  # deleted meanwhile (another run's rotation)
                continue
            found.append((int(match["batch"]), stat.st_mtime_ns, str(path.absolute()), size))
    return [(batch, path, size) for batch, _, path, size in sorted(found, reverse=True)]


def _size(path: str) -> int:
    """A file's size; a folder's (a sharded checkpoint): the sum of its files' sizes."""
    if not os.path.isdir(path):
        return os.path.getsize(path)
    return sum(entry.stat().st_size for entry in os.scandir(path) if entry.is_file())


def _seen_whole(listed: list[tuple[int, str, int]]) -> set[str]:
    """The listed paths this rank sees at the size rank 0 listed."""
    seen = set()
    for _, path, size in listed:
        try:
            if _size(path) == size:
                seen.add(path)
        except OSError:
            pass
    return seen


def _batch_of(listed: list[tuple[int, str, int]], path: str) -> int:
    return next(batch for batch, listed_path, _ in listed if listed_path == path)


def _set_aside(path: str, suffix: str = "unreadable") -> str:
    """Rename `path` to `path.unreadable` (or `.unreadable-2`, ... if taken); the new name."""
    target, n = f"{path}.{suffix}", 1
    while os.path.lexists(target):
        n += 1
        target = f"{path}.{suffix}-{n}"
    os.rename(path, target)
    return target


def _set_aside_unfinished(listed: list[tuple[int, str, int]]) -> set[str]:
    """Rename aside (`NAME.incomplete`) the sharded checkpoints whose save never finished: torch writes a
    folder's `.metadata` last, so one without it is a save cut short (a kill while ranks wrote), as a
    `.tmp-` file is for a checkpoint file: no checkpoint, and out of the way of the rerun, which saves
    that batch anew. The paths set aside."""
    unfinished = {
        path for _, path, _ in listed if os.path.isdir(path) and not os.path.exists(f"{path}/{METADATA}")
    }
    for path in sorted(unfinished):
        new = Path(_set_aside(path, "incomplete")).name
        log.warning(
            "autoresume: %s is a sharded checkpoint whose save never finished; renamed to %s", path, new
        )
    return unfinished


def _repoint_latest(folder: Path, set_aside: set[str], path: str) -> None:
    """Point the symlinks in `folder` (Composer's `latest-rank0.pt`) that named a file now set aside at
    `path`, the checkpoint resumed from, so that a load_path of `latest` finds it before the next save."""
    for link in folder.iterdir() if set_aside else ():
        if link.is_symlink() and os.path.abspath(os.path.join(folder, os.readlink(link))) in set_aside:
            with atomic_path(link) as tmp:
                tmp.symlink_to(os.path.relpath(path, folder))


def _choose(listed: list[tuple[int, str, int]], everywhere: list[str], folder: Path) -> dict:
    """Rank 0's decision: {"path": the newest checkpoint every rank sees whole and that loads, or
    None}, or {"error": one line}. Newer files that do not load are renamed aside, each with a
    warning, once a checkpoint that loads has been found (none is touched when none loads); sharded
    checkpoints whose save never finished are renamed aside whatever else is found."""
    unfinished = _set_aside_unfinished(listed)
    listed = [entry for entry in listed if entry[1] not in unfinished]
    everywhere = [path for path in everywhere if path not in unfinished]
    unreadable = []
    for path in everywhere:
        try:
            if os.path.isdir(path):  # a sharded checkpoint: complete, or skipped
                check_complete(path)
            elif path.endswith(".pt"):  # torch.save's file; a tar or compressed one is left to Composer
                read_checkpoint(path)
        except (CheckpointError, ShardedCheckpointError, FileNotFoundError) as error:
            unreadable.append((path, str(error)))
            continue
        for bad, reason in unreadable:
            log.warning(
                "autoresume: skipping %s, which does not load (%s); renamed to %s, not deleted",
                bad,
                reason,
                Path(_set_aside(bad)).name,
            )
        _repoint_latest(folder, {bad for bad, _ in unreadable} | unfinished, path)
        for batch, other, _ in listed:
            if batch > _batch_of(listed, path) and other not in everywhere:
                log.warning("autoresume: skipping %s, which not every rank sees whole", other)
        log.info("autoresume: resuming from %s, the newest complete checkpoint in %s", path, folder)
        return {"path": path}
    if unreadable:
        bad, reason = unreadable[0]
        return {
            "error": f"trainer.autoresume: none of the {len(unreadable)} checkpoints in {folder} loads "
            f"(the newest: {reason}); move them out of trainer.save_folder to start this run afresh"
        }
    if listed:  # rank 0 sees checkpoints that some rank does not
        return {
            "error": f"trainer.save_folder: {folder} holds {len(listed)} checkpoints on rank 0 that not "
            "every rank sees whole: give a folder every node shares, or an s3:// one"
        }
    log.info("autoresume: no checkpoint in %s yet; starting this run", folder)
    return {"path": None}


def local_autoresume(trainer: dict, run_name: str) -> dict:
    """`trainer` with Composer's autoresume replaced for a local, non-sharded save_folder (see the
    module docstring): `load_path` is the newest checkpoint complete for every rank, or the run's own
    `load_path` when the folder holds none. Raises ResumeError, on every rank, when checkpoints are
    there but none can be resumed. Anything else is returned unchanged."""
    folder = trainer.get("save_folder")
    if not trainer.get("autoresume") or folder is None or is_remote(folder):
        return trainer
    save_filename = trainer.get("save_filename", SAVE_FILENAME)
    pattern = checkpoint_pattern(save_filename, run_name)
    if pattern is None:
        log.warning("save_filename=%r has no {batch}: autoresume left to Composer", save_filename)
        return trainer
    folder = Path(format_name_with_dist(str(folder), run_name))
    # With NaNGuard's last good state, saved when a run stopped at a NaN: the rerun resumes from it.
    last_good = checkpoint_pattern(LAST_GOOD, run_name)
    sharded = sharded_pattern(save_filename, run_name)
    listed = on_rank_zero(lambda: local_checkpoints(folder, pattern, last_good, sharded))
    seen = dist.all_gather_object(_seen_whole(listed))
    everywhere = [path for _, path, _ in listed if all(path in rank_seen for rank_seen in seen)]
    decision = on_rank_zero(lambda: _choose(listed, everywhere, folder))
    if "error" in decision:
        raise ResumeError(decision["error"])
    trainer = {**trainer, "autoresume": False}
    return trainer if decision["path"] is None else _resume_from(trainer, decision["path"])
