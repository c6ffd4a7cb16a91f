"""Composer internals we rely on, written for mosaicml (composer) 0.32.1.

- `checkpoint._write_checkpoint_file(state_dict, filename)`: the one function that writes a local
  checkpoint file. extensions/checkpointing.py wraps it to write to a temporary name and rename it into
  place; Composer has no hook for how a file is written.
- `Trainer._rng_state`: the RNG state the Trainer loaded from a checkpoint and applies at the start
  of `fit()`. extensions/callbacks.py takes it over to apply it after the first batch is fetched, where
  an uninterrupted run had it (Composer would apply it before the dataloader draws its seed).
- `MLFlowLogger._enabled` / `._run_id`: whether this rank logs to MLflow and its run's id, to set a
  failed run back to FAILED after Composer's `mlflow.end_run()` marked it FINISHED (mlflow 3).
- `Device._device`: the torch.device of Composer's device object (no public accessor in 0.32).
- `State.fsdp_enabled` (a property) walks every module of the model (`model.modules()`) to look for
  an FSDP wrapper, and `Trainer._train_batch` asks it once a batch for its automicrobatching
  bookkeeping: ~6 ms a batch on sd2-base's module count, measured on the CPU with
  `bench/overhead.py host`, on a step that is launch-bound on an H100. The Trainer wraps the model
  (FSDP, DDP) in its `__init__`, so the answer is fixed once it is built: `cache_fsdp_enabled`
  computes it then and the property answers from that value.
- `collect_env.get_cpu_model`: `Trainer.__init__` calls `get_composer_env_dict()` to log Composer's
  version, and that dict also holds the CPU's name, which py-cpuinfo finds by running itself in a
  subprocess: 1.1 s of CPU (measured) for every Trainer built, each rank of each run (and each
  training run of the test suite). `skip_cpu_probe` makes it read the name from /proc/cpuinfo.
- `CheckpointSaver._symlink_upload_wait_before_next_try_in_seconds` (30 s in Composer, "allow unit
  test to override this"): with a remote save_folder, the `latest` pointer is uploaded once a worker
  of Composer's RemoteUploader sees the checkpoint in the bucket, polling at this interval; so the
  pointer lags its checkpoint by up to 30 s, and the end of every run waits for that poll.
  `poll_remote_checkpoints_every` sets it on a trainer's savers: one HEAD request per poll while a
  checkpoint uploads.
- `Trainer._use_closures()`: True for every precision but fp16 AMP, and then Composer hands the
  microbatches to `optimizer.step(closure)` as a closure that ends in `loss.item()`. That host sync
  sits between the backward and the optimizer's kernels, so the host launches the update only once
  the GPU has finished the backward, and the GPU then idles while it does. AdamW, Adam and SGD (and
  their subclasses: MasterWeightAdamW, Composer's decoupled ones) never call the closure for more than
  running it first, which Composer's other path does itself: `_train_microbatches`, then
  `optimizer.step()`, the path it takes for fp16. `step_without_closure` makes a trainer whose
  optimizers are all of those take it: one sync a batch fewer (tests/test_host_syncs.py).
- The module globals `ProcessPoolExecutor` and `multiprocessing` of `composer.utils.remote_uploader`:
  RemoteUploader, which uploads a remote save_folder's checkpoints, builds two pools of processes
  started with `spawn` and a multiprocessing Manager (a server process) from them in its `__init__`.
  None of those processes watches its parent: a SIGKILLed run (preemption, OOM killer) left five
  behind for ever, three of ~780 MB (each imports torch and Composer), measured by
  tests/test_killed_run.py. `upload_in_threads` swaps both names for thread-backed stand-ins, so the
  uploads run in threads of the training process and end with it however it ends (and each run saves
  the CPU of starting those processes). For the same reason every RemoteUploaderDownloader (a YAML
  logger, or one Composer makes for a profiler's remote files) defaults to `use_procs=False`, its own
  documented thread mode.
- `FSDP2Config`'s read-only `data_parallel_shard_degree` / `data_parallel_replicate_degree` (-1 and
  None: "for FSDP 1 compatibility"), which `State.__init__` (`_create_device_mesh`) reads to build
  the device mesh it then hands `fully_shard`, overwriting the config's own `device_mesh`: the one
  way to an HSDP mesh (replicate x shard) through the Trainer. `mesh_fsdp2_config` returns an
  FSDP2Config whose degrees are the run's (recipes/parallelism.py), so Composer builds a 2-D mesh
  named `dp_replicate` x `dp_shard`, which its sharded save also reads (only the first replica
  writes, over the shard group).
- Modules below the public API: `composer.algorithms.ema.ema` (EMAParameters, compute_ema: bench/ema.py
  compares against Composer's EMA update), `composer.callbacks.speed_monitor.GPU_AVAILABLE_FLOPS`
  (bench/gpu/gpu_check.py's peak FLOPS table) and the modules `LPGroupNorm` / `LPLayerNorm` below
  `composer.algorithms.low_precision_{groupnorm,layernorm}` (tests check they are swapped in).
  These are imported on first use: `composer.algorithms` is not otherwise loaded by a run.
"""

import functools
import importlib
import inspect
import platform
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
from composer.callbacks import CheckpointSaver
from composer.core import State
from composer.loggers import RemoteUploaderDownloader
from composer.utils import FSDP2Config, checkpoint, collect_env, remote_uploader

_LAZY = {
    "EMAParameters": "composer.algorithms.ema.ema",
    "compute_ema": "composer.algorithms.ema.ema",
    "GPU_AVAILABLE_FLOPS": "composer.callbacks.speed_monitor",
    "LPGroupNorm": "composer.algorithms.low_precision_groupnorm.low_precision_groupnorm",
    "LPLayerNorm": "composer.algorithms.low_precision_layernorm.low_precision_layernorm",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def checkpoint_file_writer() -> Callable[[dict[str, Any], str], None]:
    """The function Composer writes each local checkpoint file with: `(state_dict, filename)`."""
    return checkpoint._write_checkpoint_file


def set_checkpoint_file_writer(writer: Callable[[dict[str, Any], str], None]) -> None:
    """Make Composer write local checkpoint files with `writer(state_dict, filename)`."""
    checkpoint._write_checkpoint_file = writer


def take_loaded_rng_state(trainer) -> list[dict[str, Any]] | None:
    """The RNG state `trainer` loaded from a checkpoint and would apply at `fit()`'s start (None if
    none), taken out of `trainer` so that Composer does not apply it."""
    state, trainer._rng_state = trainer._rng_state, None
    return state


def mlflow_run_id(logger) -> str | None:
    """The run id of an MLFlowLogger that logs from this rank and has started its run, else None."""
    return logger._run_id if logger._enabled and logger._run_id else None


def torch_device(device):
    """The torch.device of a Composer Device (`composer.utils.get_device(...)`)."""
    return device._device


_FSDP_ENABLED_WALK = State.fsdp_enabled.fget  # Composer's own: walks model.modules()


def _fsdp_enabled(state) -> bool:
    cached = state.__dict__.get("_fsdp_enabled_cached")
    return _FSDP_ENABLED_WALK(state) if cached is None else cached


def cache_fsdp_enabled(state) -> None:
    """Make `state.fsdp_enabled` answer with what it is now, without walking the model's modules on
    every call (once a batch in Composer's training loop). Call it once the Trainer is built: the
    model is wrapped (FSDP, DDP) by then and stays so. Other States keep Composer's walk."""
    if State.fsdp_enabled.fget is not _fsdp_enabled:
        State.fsdp_enabled = property(_fsdp_enabled, doc=State.fsdp_enabled.__doc__)
    state.__dict__["_fsdp_enabled_cached"] = _FSDP_ENABLED_WALK(state)


PROBING_CPU_MODEL = collect_env.get_cpu_model  # Composer's own, which starts py-cpuinfo's process


@functools.cache
def _cpu_model() -> str:
    """The CPU's name as py-cpuinfo's `brand_raw` has it on Linux (/proc/cpuinfo's "model name")."""
    try:
        with open("/proc/cpuinfo") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
    except OSError:
        names = []
    return names[0] if names else platform.processor() or "CPU"


def skip_cpu_probe() -> None:
    """Make the environment report each Trainer logs name the CPU without starting a process."""
    collect_env.get_cpu_model = _cpu_model


# Optimizers whose step runs a closure only to get the loss first (torch's Adam, AdamW, SGD; their
# subclasses included): for them `optimizer.step()` after the microbatches is the same update.
CLOSURE_FREE = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD)


def step_without_closure(trainer, enabled: bool = True) -> bool:
    """Make `trainer` run a batch's microbatches and then `optimizer.step()`, not the microbatches as
    the step's closure (whose `loss.item()` syncs before the update is launched), when every optimizer
    is CLOSURE_FREE; returns whether it did. `enabled=False` gives Composer its own choice back."""
    trainer.__dict__.pop("_use_closures", None)
    optimizers = trainer.state.optimizers or []
    if not enabled or not optimizers or not all(isinstance(o, CLOSURE_FREE) for o in optimizers):
        return False
    trainer._use_closures = lambda: False
    return True


def steps_with_closure(trainer) -> bool:
    """Whether `trainer` hands its microbatches to `optimizer.step` as a closure."""
    return trainer._use_closures()


def poll_remote_checkpoints_every(trainer, seconds: float) -> None:
    """How often Composer looks for a checkpoint in a remote save_folder before uploading the
    `latest` pointer to it (Composer's 30 s wait, at the end of every run too)."""
    for callback in trainer.state.callbacks:
        if isinstance(callback, CheckpointSaver):
            callback._symlink_upload_wait_before_next_try_in_seconds = seconds


PROCESS_POOL = remote_uploader.ProcessPoolExecutor  # Composer's own, for a check that they are swapped


def _upload_thread_pool(max_workers=None, mp_context=None, **_) -> ThreadPoolExecutor:
    """Stands in for ProcessPoolExecutor in composer.utils.remote_uploader (`mp_context` unused)."""
    return ThreadPoolExecutor(max_workers, thread_name_prefix="checkpoint-upload")


class _ThreadContext:
    """Stands in for `multiprocessing` in composer.utils.remote_uploader, which asks it for one
    thing besides the pools' context: `get_context('spawn').Manager().Event()`, the flag that a
    checkpoint upload failed (a Manager starts a server process; a threading.Event does the job)."""

    Event = threading.Event

    @staticmethod
    def get_context(method=None):
        return _ThreadContext

    @staticmethod
    def Manager():  # noqa: N802 - multiprocessing's name
        return _ThreadContext


def upload_in_threads() -> None:
    """Make Composer upload checkpoints (RemoteUploader) and files (RemoteUploaderDownloader, unless
    it is given `use_procs=True`) from threads of this process, not from processes it spawns that
    outlive a killed run. Call it before the Trainer is built; calling it again does nothing."""
    remote_uploader.ProcessPoolExecutor = _upload_thread_pool
    remote_uploader.multiprocessing = _ThreadContext
    init = RemoteUploaderDownloader.__init__
    with_defaults = list(inspect.signature(init).parameters)[-len(init.__defaults__) :]
    defaults = list(init.__defaults__)
    defaults[with_defaults.index("use_procs")] = False
    init.__defaults__ = tuple(defaults)


class _MeshFSDP2Config(FSDP2Config):
    """An FSDP2Config whose mesh degrees are given: `shard` GPUs per copy, `replicate` copies (None: one
    copy over the whole world, a 1-D mesh)."""

    def __init__(self, shard: int, replicate: int | None, **options):
        super().__init__(**options)
        self.mesh_shard, self.mesh_replicate = shard, replicate

    @property
    def data_parallel_shard_degree(self) -> int:
        return self.mesh_shard

    @property
    def data_parallel_replicate_degree(self) -> int | None:
        return self.mesh_replicate


def mesh_fsdp2_config(shard: int, replicate: int | None, **options) -> FSDP2Config:
    """Composer's FSDP2Config (`options`: its fields) on a mesh of `replicate` x `shard` processes
    (`replicate` None: a 1-D mesh of `shard`), which Composer builds when the Trainer is made."""
    import warnings

    with warnings.catch_warnings():  # "FSDP2 Config/APIs are experimental", once per rank and config
        warnings.simplefilter("ignore", UserWarning)
        return _MeshFSDP2Config(shard, replicate, **options)
