"""A linear warmup to a constant learning rate that counts batches from 1, as torchtitan's.

torchtitan's `linear_warmup_stable_decay` (the MLPerf Flux.1 reference, torchtitan 9603aa83,
torchtitan/components/lr_scheduler.py: "0-indexed step, hence + 1 adjustments") trains batch k
(from 0) at (k + 1) / N of the lr while k < N, then at the full lr (yamls/flux-schnell-mlperf.yaml:
no decay). Composer's LinearWithWarmupScheduler gives k / N, so its first batch trains at lr 0 and
every warmup batch two behind the reference's: Composer evaluates a scheduler once when it builds it
(the lr of batch 0) and then after each batch k but before it counts that batch, still at timestamp k
(the lr of batch k + 1; composer/trainer/trainer.py `_train_loop`, 0.32.1), so its batch k trains at
(k - 1) / N, and batches 0 and 1 at lr 0 (measured: tests/test_warmup.py). CountedWarmup takes that
order into account: its first evaluation is batch 0's, every later one the next batch's. A resumed
run builds it anew (batch 0's evaluation, which the checkpoint's optimizer state then replaces) and
continues with the next batch's. Composer's defaults only: stepped every batch, one optimizer (any
number of parameter groups), no scale_schedule_ratio (refused).
"""

from composer.core import State, Time, TimeUnit
from composer.optim import ComposerScheduler


class CountedWarmup(ComposerScheduler):
    """`t_warmup`: N, in batches ("800ba"; "0ba": the full lr from the first batch). `alpha_f`: the
    factor after warmup, 1.0 only (a recipe's base sets it for Composer's LinearWithWarmupScheduler)."""

    def __init__(self, t_warmup: str, alpha_f: float = 1.0):
        self.t_warmup = Time.from_timestring(t_warmup) if isinstance(t_warmup, str) else t_warmup
        if self.t_warmup.unit != TimeUnit.BATCH or self.t_warmup.value < 0:
            raise ValueError(f"t_warmup={t_warmup!r}: give a number of batches, e.g. 800ba")
        if alpha_f != 1.0:
            raise ValueError(f"alpha_f={alpha_f}: CountedWarmup holds the lr constant after its warmup (1.0)")

        self._calls = 0  # the LambdaLR Composer builds around it evaluates it first for batch 0

    def __call__(self, state: State, ssr: float = 1.0) -> float:
        if ssr != 1.0:
            raise ValueError(f"scale_schedule_ratio={ssr}: CountedWarmup counts batches as they are (1.0)")
        # LambdaLR evaluates once per parameter group at each step, at construction too.
        groups = len(state.optimizers[0].param_groups) if state.optimizers else 1
        self._calls += 1
        batch = int(state.timestamp.batch) + (1 if self._calls > groups else 0)  # the batch this lr trains
        return min(1.0, (batch + 1) / max(self.t_warmup.value, 1))
