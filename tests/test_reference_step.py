"""recipes/reference_step.py's train_step is the step the recipe runs: over the objects a run builds,
fed the same batches, it gives the Composer path's losses, weights and EMA average bit for bit, with
one microbatch and with two, and for each objective (DDPM: tiny-cpu; rectified flow: tiny-mmdit-cpu)
with bf16 weights (fp32 masters in the optimizer), gradient clipping and two microbatches."""

import pytest
import torch
from composer.loggers import InMemoryLogger

from extensions.ema import find_ema
from recipes import build_trainer, load_config, train
from recipes.reference_step import train_step
from tests.conftest import REPO, tiny_run

TINY = REPO / "yamls" / "tiny-cpu.yaml"
BATCHES = 3
MEMORY = "+loggers.memory={_target_: composer.loggers.InMemoryLogger}"  # the batch's summed loss


def composer_run(recipe, args):
    """Composer's fit of `recipe`: (its logged loss per batch, the final state)."""
    composer = train(load_config(recipe, [*args, MEMORY]))
    (logged,) = [d for d in composer.logger.destinations if isinstance(d, InMemoryLogger)]
    # logged before the clock ticks
    return {int(t.batch) + 1: float(v) for t, v in logged.data["loss/train/total"]}, composer.state


def reference_run(recipe, args, microbatches, **options):
    """train_step over a freshly built trainer's objects (same seed, not fitted): (losses, state, EMA)."""
    state = build_trainer(load_config(recipe, args)).state
    ema = find_ema(state.algorithms)
    ema.optimizers = state.optimizers  # what Composer's FIT_START hands it
    ema.bind(state.model)
    ema.step(0, update=False)  # FIT_START: the average starts at batch 0
    batches = iter(state.train_dataloader)
    losses = {}
    for step in range(BATCHES):
        batch = next(batches)
        loss = train_step(
            state.model, batch, state.optimizers[0], state.schedulers[0], ema, step, microbatches, **options
        )
        losses[step + 1] = float(loss)
        # Composer's schedule reads the run's clock, which its loop advances after each step.
        state.timestamp = state.timestamp.to_next_batch(samples=16)
    return losses, state, ema


def same_weights(a, b) -> bool:
    first, second = a.denoiser.state_dict(), b.denoiser.state_dict()
    return all(torch.equal(first[k], second[k]) for k in first)


@pytest.mark.fit
@pytest.mark.parametrize("microbatch", [16, 8])
def test_train_step_is_the_composer_paths_step(shapes_mds, tmp_path, microbatch):
    args = [*tiny_run(shapes_mds, BATCHES), "algorithms.ema.half_life=2"]
    args.append(f"+trainer.device_train_microbatch_size={microbatch}")
    expected, trained = composer_run(TINY, args)
    losses, state, ema = reference_run(TINY, args, 16 // microbatch)

    assert losses == expected
    assert same_weights(trained.model, state.model)
    average, our_average = find_ema(trained.algorithms).averaged_state(), ema.averaged_state()
    assert average and all(torch.equal(average[k], our_average[k]) for k in average)


@pytest.mark.fit
@pytest.mark.parametrize("recipe", ["tiny-cpu", "tiny-mmdit-cpu"])
def test_the_written_out_step_is_composers_with_bf16_weights_clipping_and_two_microbatches(
    shapes_mds, recipe
):
    """Each objective's step as reference_step writes it out (latents, condition, draws, noisy input,
    target, weighted loss), on bf16 weights with fp32 masters, the gradient norm clipped to 0.05 (it
    clips: without it the weights differ) and 2 microbatches of 8: Composer's losses and weights."""
    recipe = REPO / "yamls" / f"{recipe}.yaml"
    args = [
        *tiny_run(shapes_mds, BATCHES),
        "model.param_dtype=bfloat16",
        "model.train_draws=rank",  # the global RNG's draws, which diffusion_loss writes out
        "+trainer.device_train_microbatch_size=8",
        "+algorithms.gradient_clipping={_target_: composer.algorithms.GradientClipping, "
        "clipping_type: norm, clipping_threshold: 0.05}",
    ]
    expected, trained = composer_run(recipe, args)
    losses, state, _ = reference_run(recipe, args, 2, clip_norm=0.05)

    assert state.model.denoiser_dtype == torch.bfloat16
    assert losses == expected
    assert same_weights(trained.model, state.model)
    _, unclipped, _ = reference_run(recipe, args, 2)
    assert not same_weights(unclipped.model, state.model)


def test_a_batch_that_does_not_split_evenly_is_refused():
    from recipes.reference_step import _split

    with pytest.raises(ValueError, match="a batch of 6 does not split into 4 equal microbatches"):
        _split({"x": torch.zeros(6)}, 4)
    assert [len(p["x"]) for p in _split({"x": torch.zeros(6), "c": list("abcdef")}, 3)] == [2, 2, 2]
