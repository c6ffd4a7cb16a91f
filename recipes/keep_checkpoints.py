"""`save_num_checkpoints_to_keep` over a whole run, not per start.

Composer 0.32.1's CheckpointSaver rotates only the checkpoints it saved since this process started
(its `saved_checkpoints` starts empty and is not in its state), so with the default of 2 every
resume left the earlier start's 2 behind: checkpoints piled up across restarts (issue 47). Once the
Trainer is built (the resumed checkpoint loaded), the run's own earlier checkpoints in its local
save_folder, named by its save_filename, up to the batch it resumed at, are handed to the saver, oldest
first, so its next rotation counts them. Checkpoints of later batches (the run rewound by a
load_path), other names, files set aside (`.unreadable`, `.incomplete`) and remote folders are left
alone.
"""

import logging
from pathlib import Path

from composer.callbacks import CheckpointSaver
from composer.utils import format_name_with_dist

from recipes.resume import SAVE_FILENAME, checkpoint_pattern, is_remote, local_checkpoints, sharded_pattern

log = logging.getLogger(__name__)
METADATA = ".metadata"  # a sharded checkpoint's: Composer rotates the folder its saved path is in


def adopt_earlier_checkpoints(
    trainer, save_folder: str | None, save_filename: str | None, run_name: str
) -> int:
    """Hand the run's earlier local checkpoints to the Trainer's CheckpointSaver; how many."""
    saver = next((c for c in trainer.state.callbacks if isinstance(c, CheckpointSaver)), None)
    if saver is None or saver.num_checkpoints_to_keep < 0 or not save_folder or is_remote(save_folder):
        return 0
    folder = Path(format_name_with_dist(save_folder, run_name))
    filename = format_name_with_dist(save_filename or SAVE_FILENAME, run_name)  # this rank's files
    patterns = [p for p in (checkpoint_pattern(filename, run_name), sharded_pattern(filename, run_name)) if p]
    if not patterns or not folder.is_dir():
        return 0
    now = int(trainer.state.timestamp.batch)
    held = set(saver.saved_checkpoints)
    earlier = []
    for batch, path, _ in reversed(local_checkpoints(folder, *patterns)):  # oldest first
        saved = str(Path(path) / METADATA) if Path(path).is_dir() else path
        if batch <= now and saved not in held:
            earlier.append(saved)
    saver.saved_checkpoints[:0] = earlier
    if earlier:
        log.info(
            "checkpoints: %d earlier ones in %s count toward save_num_checkpoints_to_keep=%d",
            len(earlier), folder, saver.num_checkpoints_to_keep,
        )  # fmt: skip
    return len(earlier)
