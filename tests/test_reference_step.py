"""recipes/reference_step.py's train_step is the step the recipe runs: over the objects a run builds,
fed the same batches, it gives the Composer path's losses, weights and EMA average bit for bit, with
one microbatch and with two."""

import pytest
import torch
from composer.loggers import InMemoryLogger

from extensions.ema import find_ema
from recipes import build_trainer, load_config, train
from recipes.reference_step import train_step
from tests.conftest import REPO, tiny_run

TINY = REPO / "yamls" / "tiny-cpu.yaml"
BATCHES = 3


@pytest.mark.fit
@pytest.mark.parametrize("microbatch", [16, 8])
def test_train_step_is_the_composer_paths_step(shapes_mds, tmp_path, microbatch):
    args = [*tiny_run(shapes_mds, BATCHES), "algorithms.ema.half_life=2"]
    args.append(f"+trainer.device_train_microbatch_size={microbatch}")
    memory = "+loggers.memory={_target_: composer.loggers.InMemoryLogger}"  # the batch's summed loss
    composer = train(load_config(TINY, [*args, memory]))
    (logged,) = [d for d in composer.logger.destinations if isinstance(d, InMemoryLogger)]
    expected = {
        int(t.batch) + 1: float(v) for t, v in logged.data["loss/train/total"]
    }  # logged before the clock ticks

    state = build_trainer(load_config(TINY, args)).state  # the same objects, freshly seeded; not fitted
    ema = find_ema(state.algorithms)
    ema.optimizers = state.optimizers  # what Composer's FIT_START hands it
    ema.bind(state.model)
    ema.step(0, update=False)  # FIT_START: the average starts at batch 0
    batches = iter(state.train_dataloader)
    losses = {}
    for step in range(BATCHES):
        batch = next(batches)
        loss = train_step(
            state.model, batch, state.optimizers[0], state.schedulers[0], ema, step, 16 // microbatch
        )
        losses[step + 1] = float(loss)
        # Composer's schedule reads the run's clock, which its loop advances after each step.
        state.timestamp = state.timestamp.to_next_batch(samples=16)

    assert losses == expected
    trained, ours = composer.state.model.unet.state_dict(), state.model.unet.state_dict()
    assert all(torch.equal(trained[k], ours[k]) for k in trained)
    average, our_average = find_ema(composer.state.algorithms).averaged_state(), ema.averaged_state()
    assert average and all(torch.equal(average[k], our_average[k]) for k in average)


def test_a_batch_that_does_not_split_evenly_is_refused():
    from recipes.reference_step import _split

    with pytest.raises(ValueError, match="a batch of 6 does not split into 4 equal microbatches"):
        _split({"x": torch.zeros(6)}, 4)
    assert [len(p["x"]) for p in _split({"x": torch.zeros(6), "c": list("abcdef")}, 3)] == [2, 2, 2]
