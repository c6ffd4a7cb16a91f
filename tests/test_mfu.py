"""MFU comes from the SpeedMonitor in _base.yaml (Composer's, with FLOPs counted on the host:
extensions/speed_monitor.py): the model's flops_per_batch (UNet training FLOPs) and the peak FLOP/s set
in the YAML (`callbacks.speed_monitor.gpu_flops_available`)."""

import pytest
from composer.core import Callback
from composer.loggers import InMemoryLogger

from models import flops
from recipes import build_trainer, load_config
from tests.conftest import REPO, tiny_run

BATCHES = 4
PEAK = 2.0e12  # FLOP/s: any number; a CPU has no entry in Composer's table


class _BatchClock(Callback):
    """What SpeedMonitor reads at each batch end: the batch and the training wall clock."""

    def __init__(self):
        self.rows = []

    def batch_end(self, state, logger):
        self.rows.append((state.batch["image"].shape[0], state.timestamp.total_wct.total_seconds()))


@pytest.mark.fit
def test_speed_monitor_logs_mfu_from_unet_flops_and_the_yaml_peak(shapes_mds, tmp_path):
    overrides = [
        *tiny_run(shapes_mds, BATCHES),
        "callbacks.speed_monitor.window_size=1",
        f"callbacks.speed_monitor.gpu_flops_available={PEAK}",
        "+loggers.memory={_target_: composer.loggers.InMemoryLogger}",
    ]
    trainer = build_trainer(load_config(REPO / "yamls/tiny-cpu.yaml", overrides))
    clock = _BatchClock()
    trainer.state.callbacks.append(clock)
    trainer.fit()
    trainer.close()
    memory = next(d for d in trainer.logger.destinations if isinstance(d, InMemoryLogger))

    # Counted independently: the preset's UNet at 32 px (8x8 latents), forward + backward, per image.
    per_image = flops.training_flops_per_image("tiny", 32)
    model = trainer.state.model
    assert model.flops_per_batch(trainer.state.batch) == pytest.approx(16 * per_image, rel=1e-9)
    mfu = [value for _, value in memory.data["throughput/device/mfu"]]
    flops_per_sec = [value for _, value in memory.data["throughput/device/flops_per_sec"]]
    assert len(mfu) == len(flops_per_sec) == BATCHES - 1  # from the second batch on (window of 1)
    expected = [
        n * per_image / (wct - previous_wct)
        for (_, previous_wct), (n, wct) in zip(clock.rows, clock.rows[1:], strict=False)
    ]
    assert flops_per_sec == pytest.approx(expected, rel=1e-5)
    assert mfu == pytest.approx([e / PEAK for e in expected], rel=1e-5)
    assert all(0 < value < 1 for value in mfu)  # a 2-core CPU is far below 2 TFLOP/s
    samples_per_sec = [value for _, value in memory.data["throughput/samples_per_sec"]]
    assert samples_per_sec == pytest.approx([e / per_image for e in expected], rel=1e-5)
