"""One training step as a plain PyTorch loop writes it: what Composer runs for this recipe each batch,
in one place to read (nanoGPT's train.py and DiT's train.py show theirs the same way).

Composer adds around it: the time bookkeeping and checkpoints, the callbacks (NaN guard, speed and
memory monitors, sample grids), loggers, evaluation, and the process group and samplers of several
processes. The step itself is this; `tests/test_reference_step.py` checks that it gives the Composer
path's losses and weights bit for bit, and `bench/plain_loop.py` times it against the Trainer.
"""


def train_step(
    model,
    batch: dict,
    optimizer,
    scheduler=None,
    ema=None,
    step: int = 0,
    microbatches: int = 1,
    seed: int = 0,
):
    """Train `model` on one global batch (this process's part of it) and return the loss (a tensor
    on the model's device, so a GPU step never waits for the host).

    The batch is split into `microbatches` equal parts whose gradients add up (each loss scaled by
    its share of the batch, as Composer does), then the optimizer and the learning-rate schedule
    step once, and the EMA (extensions/ema.py) averages the new weights. `step`: the number of
    batches trained before this one (the EMA starts and decays by batch count). A model that draws
    per sample (`model.train_draws: sample`) keys its draws by `seed` (the run's) and `step`, as
    extensions/sample_draws.py tells it under Composer.
    """
    if getattr(model, "train_draws", "rank") == "sample":
        model.draw_key = (seed, step)
    model.train()
    optimizer.zero_grad(set_to_none=True)
    size = len(next(iter(batch.values())))
    total = 0.0
    for part in _split(batch, microbatches):
        share = len(next(iter(part.values()))) / size
        loss = model.loss(model(part), part) * share  # the objective's mean over this part
        loss.backward()
        total = total + loss.detach()  # on the loss's device: no host sync
    optimizer.step()
    if scheduler is not None:
        scheduler.step()
    if ema is not None:
        ema.step(step + 1)  # after the update, as at Composer's BATCH_END
    return total


def _split(batch: dict, parts: int) -> list[dict]:
    """`batch` cut along its first dimension into `parts` (tensors) or slices (lists)."""
    size = len(next(iter(batch.values())))
    if parts < 1 or size % parts:
        raise ValueError(f"a batch of {size} does not split into {parts} equal microbatches")
    step = size // parts
    return [{k: v[i : i + step] for k, v in batch.items()} for i in range(0, size, step)]
