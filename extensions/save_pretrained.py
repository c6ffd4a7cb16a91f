"""`SavePretrained`: at the end of training, write the model in diffusers format for the next stage.

The autoencoder recipe (yamls/tiny-vae.yaml) uses it so the diffusion recipe can load the VAE with
`model.pretrained: FOLDER`. Only rank 0 writes; the others wait, so no rank reads a half-written folder.

The folder is written beside its final name and renamed into place, with `save-pretrained.json`
naming the run that wrote it. A run replaces only its own export: `folder` must be absent, empty, or
hold that file with the same run_name (a rerun of the same recipe). A folder with anything else in
it (a pipeline of the user's, another run's export, an export from before the file existed) is
refused when the config is parsed, or at fit start for another run's, before any training.
"""

import json
import logging
from pathlib import Path

from composer.core import Callback, State
from composer.loggers import Logger
from composer.utils import dist

from common.atomic import atomic_path

log = logging.getLogger(__name__)

MARK = "save-pretrained.json"  # in the export: who wrote it, so a rerun knows it may replace it
WRITER = "extensions.save_pretrained.SavePretrained"


class SavePretrained(Callback):
    def __init__(self, folder: str):
        self.folder = folder
        check_folder(Path(folder))  # at config parse time (recipes/config.py builds every callback)

    def fit_start(self, state: State, logger: Logger) -> None:
        _exportable(state)  # a wrong model fails now, not after the whole run
        check_folder(Path(self.folder), state.run_name)

    def fit_end(self, state: State, logger: Logger) -> None:
        model = _exportable(state)
        if dist.get_global_rank() == 0:
            check_folder(Path(self.folder), state.run_name)  # again: it may have been filled meanwhile
            # Written beside and renamed into place, the run's earlier export swapped out: a kill
            # mid-save leaves no folder that the next stage would take for a finished one.
            with atomic_path(self.folder, existing="swap") as tmp:
                model.save_pretrained(tmp)
                mark = {"writer": WRITER, "run_name": state.run_name, "model": type(model).__name__}
                (tmp / MARK).write_text(json.dumps(mark, indent=1) + "\n")
            log.info("saved %s to %s", type(model).__name__, self.folder)
        dist.barrier()


def check_folder(folder: Path, run_name: str | None = None) -> None:
    """`folder` may be written by run `run_name` (None: by some run of SavePretrained): it is absent,
    empty, or this callback's export of the same run. A ValueError naming `folder=` otherwise."""
    if folder.is_symlink() or (folder.exists() and not folder.is_dir()):
        raise ValueError(f"folder={folder} is a file, not a folder: give SavePretrained a folder of its own")
    if not folder.is_dir() or not any(folder.iterdir()):
        return
    try:
        mark = json.loads((folder / MARK).read_text())
    except (OSError, ValueError):
        mark = None
    if not isinstance(mark, dict) or mark.get("writer") != WRITER:
        raise ValueError(
            f"folder={folder} holds files that no SavePretrained run wrote (no {MARK}): nothing is "
            "replaced; give callbacks.save_pretrained.folder a new folder, or move that one away"
        )
    if run_name is not None and mark.get("run_name") != run_name:
        raise ValueError(
            f"folder={folder} holds the export of run {mark.get('run_name')!r}, not of this run "
            f"({run_name!r}): nothing is replaced; give callbacks.save_pretrained.folder another folder"
        )


def _exportable(state: State):
    model = getattr(state.model, "module", state.model)  # unwrap DDP
    if not hasattr(model, "save_pretrained"):
        raise TypeError(f"{type(model).__name__} has no save_pretrained(); SavePretrained cannot export it")
    return model
