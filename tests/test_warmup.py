"""extensions/warmup.py CountedWarmup, the MLPerf Flux.1 reference's warmup: a run's learning rate at each
batch against torchtitan's formula (written here from its lr_scheduler.py: step k from 0 gets
(k + 1) / N while k < N, then 1), also across a resume; Composer's own warmup, the control, gives
(k - 1) / N."""

import pytest
from composer import Callback

from extensions.warmup import CountedWarmup
from recipes import build_trainer, load_config
from tests.conftest import REPO, tiny_run

LR, WARMUP, BATCHES = 3e-3, 3, 5
COUNTED = ["scheduler._target_=extensions.warmup.CountedWarmup", "~scheduler.alpha_f"]
COMPOSERS = ["scheduler._target_=composer.optim.LinearWithWarmupScheduler", "scheduler.alpha_f=1.0"]


def torchtitan_factor(current_step: int, warmup_steps: int) -> float:
    if current_step < warmup_steps:
        current_step += 1
        return float(current_step / warmup_steps)
    return 1.0  # warmup_stable_decay with no decay steps


def _rates(shapes_mds, batches: int, *overrides: str) -> list[float]:
    """The lr each batch of a tiny run trains at."""
    common = [*tiny_run(shapes_mds, batches), f"scheduler.t_warmup={WARMUP}ba", f"optimizer.lr={LR}"]
    trainer = build_trainer(load_config(REPO / "yamls/tiny-cpu.yaml", [*common, *overrides]))
    seen = []

    class Rates(Callback):
        def before_train_batch(self, state, logger):
            seen.append(state.optimizers[0].param_groups[0]["lr"])

    trainer.state.callbacks.append(Rates())
    trainer.fit()
    trainer.close()
    return seen


@pytest.mark.fit
def test_each_batch_trains_at_the_references_warmup_learning_rate_also_after_a_resume(shapes_mds, tmp_path):
    expected = [LR * torchtitan_factor(k, WARMUP) for k in range(BATCHES)]
    assert _rates(shapes_mds, BATCHES, *COUNTED) == pytest.approx(expected, rel=1e-12)
    assert _rates(shapes_mds, 3, *COMPOSERS) == pytest.approx([0, 0, LR / WARMUP], rel=1e-12)

    saved = [f"trainer.save_folder={tmp_path}", "trainer.save_interval=2ba", *COUNTED]
    assert _rates(shapes_mds, 2, *saved) == pytest.approx(expected[:2], rel=1e-12)
    assert _rates(shapes_mds, BATCHES, *saved) == pytest.approx(expected[2:], rel=1e-12)  # resumed at 2


def test_warmup_in_batches_only_and_no_decay():
    with pytest.raises(ValueError, match="give a number of batches"):
        CountedWarmup("1000sp")
    with pytest.raises(ValueError, match="holds the lr constant"):
        CountedWarmup("800ba", alpha_f=0.5)
    assert CountedWarmup("0ba", alpha_f=1.0).t_warmup.value == 0
