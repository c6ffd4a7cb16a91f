"""Host synchronisations per training batch of the tiny recipe with sd2-base's fused AdamW (and the
tiny recipe's EMA, NaN guard, clipping and monitors): each one stalls the host until the GPU catches
up, and on a launch-bound step (sd2-base at 256 px on an H100) the GPU then idles while the host
launches the next kernels. The count must not grow with the number of microbatches.

Counted on the CPU with a dispatch mode over the training thread: the ops that need a tensor's value
on the host (`.item()`, `bool(tensor)`, data-dependent shapes). Measured (2026-11-26): 7 a batch.
Composer 0.32.1 makes 6 of them: the batch-size all-reduce, the end-of-data flag, the loss for
logging and 3 in the time bookkeeping (`_accumulate_time_across_ranks`); the NaN guard makes one.
Composer's closure for `optimizer.step(closure)` made an eighth (`loss.item()`, between the backward
and the update: compat/composer.py step_without_closure), and its SpeedMonitor a ninth (its FLOPs
all-reduce for MFU; extensions/speed_monitor.py counts FLOPs on the host instead)."""

import gc

import pytest
import torch
from composer.core import Callback

from compat.composer import step_without_closure, steps_with_closure
from compat.torch import TorchDispatchMode
from recipes import build_trainer, load_config
from tests.conftest import REPO, tiny_run

MAX_SYNCS = 7  # what it is today (see above): a new sync anywhere fails this test
SYNC_OPS = {
    torch.ops.aten._local_scalar_dense.default,  # .item(), float(t), bool(t), if t:
    torch.ops.aten.nonzero.default,
    torch.ops.aten.masked_select.default,
    torch.ops.aten.is_nonzero.default,
    torch.ops.aten.equal.default,
    torch.ops.aten.unique_consecutive.default,
    torch.ops.aten._unique2.default,
}


class SyncCount(Callback):
    """Counts sync ops on the training thread from fit start; `per_batch[i]` is what ran between the
    start of batch i and the start of batch i + 1 (a batch's step, its callbacks and bookkeeping)."""

    def __init__(self):
        self.count, self.marks = 0, []
        counter = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                if func in SYNC_OPS:
                    counter.count += 1
                return func(*args, **(kwargs or {}))

        self.mode = Mode()

    def fit_start(self, state, logger):
        self.mode.__enter__()

    def batch_start(self, state, logger):
        self.marks.append(self.count)

    def fit_end(self, state, logger):
        self.marks.append(self.count)
        self.mode.__exit__(None, None, None)

    @property
    def per_batch(self) -> list[int]:
        return [b - a for a, b in zip(self.marks, self.marks[1:])]


def syncs_per_batch(shapes_mds, microbatch: int) -> list[int]:
    overrides = [
        *tiny_run(shapes_mds, 4),
        "global_train_batch_size=8",
        f"trainer.device_train_microbatch_size={microbatch}",
        # sd2-base's AdamW. The tiny recipe's default, for-each AdamW reads every step counter with
        # .item() (a CPU tensor there, so no GPU sync, but counted here like one).
        "optimizer.fused=true",
    ]
    trainer = build_trainer(load_config(REPO / "yamls/tiny-cpu.yaml", overrides))
    counter = SyncCount()
    trainer.state.callbacks.append(counter)
    trainer.fit()
    trainer.close()
    del trainer
    gc.collect()  # the streaming dataset's shared memory, before the next run opens it
    return counter.per_batch[1:-1]  # not the first batch's warm-up nor the last one's teardown


pytestmark = pytest.mark.fit


@pytest.fixture(scope="module")
def counts(shapes_mds):
    return {micro: syncs_per_batch(shapes_mds, micro) for micro in (8, 4, 1)}


def test_syncs_per_batch_do_not_grow_with_microbatches_and_stay_few(counts):
    one, two, eight = counts[8], counts[4], counts[1]  # microbatches per batch: 1, 2, 8
    assert len(one) == 2 and len(set(one)) == 1, one  # every steady batch alike
    assert one == two == eight, f"1 microbatch: {one}, 2: {two}, 8: {eight}"
    assert 0 < one[0] <= MAX_SYNCS, one


def test_the_step_without_composers_closure_is_the_same_update(shapes_mds):
    """Composer's closure path (`optimizer.step(closure)`) and ours (the microbatches, then
    `optimizer.step()`) give the same losses and weights, bitwise, over 3 batches of 2 microbatches."""
    runs = []
    overrides = [*tiny_run(shapes_mds, 3), "global_train_batch_size=8"]
    overrides.append("trainer.device_train_microbatch_size=4")  # 2 microbatches a batch
    for closure in (True, False):
        trainer = build_trainer(load_config(REPO / "yamls/tiny-cpu.yaml", overrides))
        assert steps_with_closure(trainer) is False  # build_trainer's choice
        step_without_closure(trainer, enabled=not closure)
        assert steps_with_closure(trainer) is closure
        losses = LossRecord()
        trainer.state.callbacks.append(losses)
        trainer.fit()
        trainer.close()
        runs.append((losses.losses, {k: v.clone() for k, v in trainer.state.model.unet.state_dict().items()}))
        del trainer
        gc.collect()
    (with_closure, weights), (without, weights_without) = runs
    assert len(with_closure) == 3 and with_closure == without
    assert all(torch.equal(weights[k], weights_without[k]) for k in weights)


class LossRecord(Callback):
    def __init__(self):
        self.losses = []

    def batch_end(self, state, logger):
        self.losses.append(float(state.loss))


class ModuleWalks(Callback):
    """Counts walks over the whole model (`model.modules()`) per batch after the first."""

    def __init__(self):
        self.walks, self.marks = 0, []

    def fit_start(self, state, logger):
        walk, counter = state.model.modules, self

        def counting_walk(*args, **kwargs):
            counter.walks += 1
            return walk(*args, **kwargs)

        state.model.modules = counting_walk  # this instance only

    def batch_start(self, state, logger):
        self.marks.append(self.walks)


def test_no_batch_walks_every_module_of_the_model(shapes_mds):
    """Composer's `State.fsdp_enabled` walks every module (thousands in sd2-base) and its training loop
    asks it once a batch: ~6 ms a batch of host time. build_trainer caches the answer
    (compat/composer.py cache_fsdp_enabled)."""
    trainer = build_trainer(load_config(REPO / "yamls/tiny-cpu.yaml", tiny_run(shapes_mds, 4)))
    walks = ModuleWalks()
    trainer.state.callbacks.append(walks)
    trainer.fit()
    trainer.close()
    assert trainer.state.fsdp_enabled is False
    steady = [b - a for a, b in zip(walks.marks[1:], walks.marks[2:])]
    del trainer
    gc.collect()
    assert steady == [0, 0], steady
