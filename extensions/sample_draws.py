"""SampleDraws: tells a model that draws per sample (`model.train_draws: sample`, models/engine/draw_keys.py)
the run's seed and the index of the batch it trains, before each batch.

The batch index is Composer's timestamp, which a checkpoint holds, so a resumed run (on any number of
processes) keys the same batch's draws the same: no random state to save or restore.
"""

from composer.core import Callback, State
from composer.loggers import Logger


class SampleDraws(Callback):
    def __init__(self, seed: int):
        self.seed = int(seed)

    def batch_start(self, state: State, logger: Logger) -> None:
        model = getattr(state.model, "module", state.model)  # DDP wraps the model; FSDP2 shards in place
        model.draw_key = (self.seed, int(state.timestamp.batch))
