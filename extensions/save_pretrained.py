"""`SavePretrained`: at the end of training, write the model in diffusers format for the next stage.

The autoencoder recipe (yamls/tiny-vae.yaml) uses it so the diffusion recipe can load the VAE with
`model.pretrained: FOLDER`. Only rank 0 writes; the others wait, so no rank reads a half-written folder.
"""

import logging

from composer.core import Callback, State
from composer.loggers import Logger
from composer.utils import dist

from common.atomic import atomic_path

log = logging.getLogger(__name__)


class SavePretrained(Callback):
    def __init__(self, folder: str):
        self.folder = folder

    def fit_start(self, state: State, logger: Logger) -> None:
        _exportable(state)  # a wrong model fails now, not after the whole run

    def fit_end(self, state: State, logger: Logger) -> None:
        model = _exportable(state)
        if dist.get_global_rank() == 0:
            # Written beside and renamed into place, an earlier export swapped out: a kill mid-save
            # leaves no folder that the next stage would take for a finished one.
            with atomic_path(self.folder, existing="swap") as tmp:
                model.save_pretrained(tmp)
            log.info("saved %s to %s", type(model).__name__, self.folder)
        dist.barrier()


def _exportable(state: State):
    model = getattr(state.model, "module", state.model)  # unwrap DDP
    if not hasattr(model, "save_pretrained"):
        raise TypeError(f"{type(model).__name__} has no save_pretrained(); SavePretrained cannot export it")
    return model
