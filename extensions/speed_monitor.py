"""Composer's SpeedMonitor without its host synchronisation: the same metrics, the FLOPs counted on
the host.

Composer 0.32.1's `SpeedMonitor.batch_end` (composer/callbacks/speed_monitor.py) puts each rank's
`flops_per_batch` in a device tensor, all-reduces it and reads it back with `.item()`: one host sync
per batch, which on a launch-bound step (sd2-base at 256 px on an H100) lets the GPU run dry while
the host waits. Our models count FLOPs from the batch's shapes on the host (models/flops.py), and
every rank's batch has the same shapes (one resolution, or with aspect-ratio buckets one stream per
global batch: `batching_method: per_stream`), so the global count is this rank's times the world
size, with no collective. (With `device_per_stream` ranks may hold different buckets: the per-device
figures and MFU stay this rank's own, the global FLOP/s is then this rank's scaled.) Everything else
(the window, the metric names, MFU against `gpu_flops_available`, the time metrics) is Composer's.
"""

from composer.callbacks import SpeedMonitor as ComposerSpeedMonitor
from composer.core import State
from composer.loggers import Logger
from composer.models import ComposerModel
from composer.utils import dist


class SpeedMonitor(ComposerSpeedMonitor):
    """`composer.callbacks.SpeedMonitor`'s metrics with no host sync per batch (see the module's
    docstring); takes the same arguments."""

    def batch_end(self, state: State, logger: Logger):
        self.history_samples.append(state.timestamp.sample.value)
        self.history_tokens.append(state.timestamp.token.value)
        self.history_wct.append(state.timestamp.total_wct.total_seconds())
        world_size = dist.get_world_size()
        if len(self.history_wct) == self.history_wct.maxlen:
            self._log_throughput(logger, world_size)

        model = state.model if isinstance(state.model, ComposerModel) else state.model.module  # DDP
        flops_per_batch = getattr(model, "flops_per_batch", None)
        if flops_per_batch is not None:
            if not callable(flops_per_batch):
                raise TypeError(f"flops_per_batch must be a callable of a batch, not {type(flops_per_batch)}")
            self.history_flops.append(float(flops_per_batch(state.batch)) * world_size)
        if len(self.history_flops) == self.history_flops.maxlen:
            flops_per_sec = (sum(self.history_flops) - self.history_flops[0]) / self._elapsed_wct()
            per_device = flops_per_sec / world_size
            logger.log_metrics(
                {"throughput/flops_per_sec": flops_per_sec, "throughput/device/flops_per_sec": per_device}
            )
            if self.gpu_flops_available:
                logger.log_metrics({"throughput/device/mfu": per_device / self.gpu_flops_available})

        train_wct = state.timestamp.total_wct.total_seconds()
        logger.log_metrics(
            {
                "time/train": train_wct / self.divider,
                "time/val": self.total_eval_wct / self.divider,
                "time/total": (train_wct + self.total_eval_wct) / self.divider,
            }
        )

    def _elapsed_wct(self) -> float:
        return self.history_wct[-1] - self.history_wct[0]

    def _log_throughput(self, logger: Logger, world_size: int) -> None:
        batches = len(self.history_samples) - 1
        samples = int(self.history_samples[-1]) - int(self.history_samples[0])
        tokens = int(self.history_tokens[-1]) - int(self.history_tokens[0])
        elapsed = self._elapsed_wct()
        metrics = {
            "throughput/batches_per_sec": batches / elapsed,
            "throughput/samples_per_sec": samples / elapsed,
            "throughput/device/batches_per_sec": batches / elapsed / world_size,
            "throughput/device/samples_per_sec": samples / elapsed / world_size,
        }
        if tokens > 0:
            metrics["throughput/tokens_per_sec"] = tokens / elapsed
            metrics["throughput/device/tokens_per_sec"] = tokens / elapsed / world_size
        logger.log_metrics(metrics)
