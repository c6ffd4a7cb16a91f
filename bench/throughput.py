"""Training throughput of a recipe on this machine, written where `recipes.plan` reads it.

    python bench/throughput.py yamls/sd2-base.yaml --batches 30 --warmup 10 [key=value ...] \
        --out bench/throughput.json
    python -m recipes.plan yamls/sd2-base.yaml --throughput-file bench/throughput.json

Trains the recipe for `--warmup + --batches` batches on synthetic data (the demo's shapes, resized
to the recipe's resolution; nothing is downloaded, and data loading is not what is measured) and
reports images/s per device over the timed batches: the global batch times batches per second,
divided by the number of processes. Run it under `composer -n GPUS` on one node to measure what a
node does; all ranks read one data folder (`--data`, made on first use), whose epoch should hold
the warm-up, timed and profiled batches (a warning says when it does not; gpu-check makes it so).
Random weights are fine for speed, so `model.pretrained` is dropped. Checkpointing, autoresume,
algorithms (EMA) and loggers are switched off.

Per-device throughput hardly depends on gradient accumulation, so on fewer GPUs than the recipe
was written for, shrink the global batch (`global_train_batch_size=64` on one GPU with microbatch
8: eight accumulation steps a batch) instead of waiting minutes per batch.

`--profile PATH.json` profiles `--profile-steps` more batches after the timed ones (so the
profiler's overhead stays out of the rate) and writes bench/profile_summary.py's summary there
(rank 0): GPU-busy fraction, kernel launches and host syncs per step, the top kernels.

Prints one line (and writes the JSON on rank 0): images/s per device, batches/s and the device.
"""

import argparse
import logging
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[0] = str(REPO)  # not bench/: its convert.py would shadow the convert package

import torch  # noqa: E402
from composer.core import Callback, State  # noqa: E402
from composer.loggers import Logger  # noqa: E402
from composer.utils import dist  # noqa: E402
from omegaconf import open_dict  # noqa: E402

from bench import profile_summary  # noqa: E402
from recipes import build_trainer, load_config  # noqa: E402
from recipes.plan import write_throughput  # noqa: E402


class BatchClock(Callback):
    """Wall time at the end of every batch (after the optimizer step, synchronised on GPUs)."""

    def __init__(self):
        self.ends: list[float] = []

    def batch_end(self, state: State, logger: Logger) -> None:
        if torch.cuda.is_available():
            with torch.profiler.record_function(f"{profile_summary.BENCH_MARK}clock"):  # not the step's sync
                torch.cuda.synchronize()
        self.ends.append(time.perf_counter())


class ProfileWindow(Callback):
    """torch.profiler over batches `first` .. `first + steps - 1` (0-based), from the first one's
    start to the last one's end (after BatchClock's synchronize at each end)."""

    def __init__(self, first: int, steps: int):
        self.first, self.steps, self.done = first, steps, 0
        self.profile = profile_summary.StepProfile(steps)

    def batch_start(self, state: State, logger: Logger) -> None:
        if self.done == self.first:
            self.profile.start()

    def batch_end(self, state: State, logger: Logger) -> None:
        self.done += 1
        if self.done == self.first + self.steps:
            self.profile.stop()


def device_name() -> str:
    if torch.cuda.is_available():
        return torch.cuda.get_device_name()
    return f"cpu ({torch.get_num_threads()} threads)"


def measure(
    yaml_path: str, batches: int, warmup: int, overrides: list[str], data_dir: str, profile_steps: int = 0
) -> dict:
    """The result record; with `profile_steps`, its "profile" is the profiled batches' summary."""
    overrides = [
        f"data.train.local={data_dir}",
        "data.train.remote=null",
        "data.train.prepare=shapes",
        "data.eval=null",
        "model.pretrained=null",
        "prepare_pretrained=null",
        f"trainer.max_duration={warmup + batches + profile_steps}ba",
        "trainer.save_folder=null",
        "trainer.autoresume=false",
        "trainer.load_path=null",  # sd2-base-512 loads stage 1; random weights time the same
        "trainer.progress_bar=false",
        *overrides,
    ]
    cfg = load_config(yaml_path, overrides)
    with open_dict(cfg):  # an override `loggers={}` would merge into them, not remove them
        cfg.loggers, cfg.algorithms = {}, {}
        cfg.callbacks.pop("samples", None)  # sampling is not training throughput
    resolution = int(cfg.data.train.resolution)
    trainer = build_trainer(cfg)
    per_epoch, total = trainer.state.dataloader_len, warmup + batches + profile_steps
    if per_epoch is not None and int(per_epoch) < total:  # the data loader's workers restart in the window
        logging.warning(
            "%s holds %d batches an epoch, fewer than the %d run: an epoch's end falls inside the "
            "measured batches; give --data more samples", cfg.data.train.local, int(per_epoch), total,
        )  # fmt: skip
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    clock = BatchClock()
    trainer.state.callbacks.append(clock)  # engine runs state.callbacks at every event
    window = ProfileWindow(warmup + batches, profile_steps) if profile_steps else None
    if window and dist.get_global_rank() == 0:
        trainer.state.callbacks.append(window)
    trainer.fit()
    timed = clock.ends[warmup - 1 : warmup + batches]
    seconds = timed[-1] - timed[0]
    batches_per_s = (len(timed) - 1) / seconds
    global_batch = int(trainer.state.dataloader.batch_size) * dist.get_world_size()
    algorithms = [type(a).__name__ for a in trainer.state.algorithms]
    loggers = [type(d).__name__ for d in trainer.logger.destinations]
    trainer.close()
    profile = None
    if window and dist.get_global_rank() == 0:
        try:
            profile = window.profile.summary()
        except Exception as err:  # noqa: BLE001 - the rate is measured; the profile is extra
            logging.warning("no profile summary: %s: %s", type(err).__name__, err)
    return {
        "img_per_sec_per_gpu": batches_per_s * global_batch / dist.get_world_size(),
        "batches_per_sec": batches_per_s,
        "resolution": resolution,
        "global_batch": global_batch,
        "world_size": dist.get_world_size(),
        "device": device_name(),
        "timed_batches": len(timed) - 1,
        "batches_per_epoch": int(per_epoch) if per_epoch is not None else None,
        "peak_memory_gb": torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None,
        "recipe": str(yaml_path),
        "preset": str(cfg.model.preset),  # recipes.plan notes a rate used for another preset
        "algorithms": algorithms,
        "loggers": loggers,
        "overrides": overrides,
        **({"profile": profile} if profile else {}),
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("yaml", help="the recipe, e.g. yamls/sd2-base.yaml")
    parser.add_argument("overrides", nargs="*", help="key=value overrides (e.g. model.preset=tiny)")
    parser.add_argument("--batches", type=int, default=30, help="timed batches")
    parser.add_argument("--warmup", type=int, default=10, help="untimed batches first (compile, cache)")
    parser.add_argument("--out", default=str(REPO / "bench/throughput.json"), help="JSON for recipes.plan")
    parser.add_argument(
        "--data", default=str(REPO / "runs/throughput-shapes"), help="synthetic MDS folder, shared by ranks"
    )
    parser.add_argument("--profile", metavar="PATH.json", help="profile batches after the timed ones")
    parser.add_argument("--profile-steps", type=int, default=3, help="how many, with --profile")
    args = parser.parse_intermixed_args(argv)  # overrides may follow the options
    if args.batches < 1 or args.warmup < 1 or args.profile_steps < 1:
        parser.error("--batches, --warmup and --profile-steps must be at least 1")
    logging.basicConfig(level=logging.WARNING)
    steps = args.profile_steps if args.profile else 0
    result = measure(args.yaml, args.batches, args.warmup, args.overrides, args.data, steps)
    if dist.get_global_rank() == 0:
        profile = result.pop("profile", None)
        write_throughput(args.out, **result)
        if profile:
            profile_summary.write(args.profile, profile, device=result["device"], recipe=result["recipe"],
                                  resolution=result["resolution"], global_batch=result["global_batch"],
                                  overrides=result["overrides"])  # fmt: skip
            print(f"profile: {profile_summary.one_line(profile)} -> {args.profile}")
        print(
            f"{result['img_per_sec_per_gpu']:.2f} img/s per device "
            f"({result['batches_per_sec']:.3f} batches/s, "
            f"global batch {result['global_batch']}, {result['world_size']} x {result['device']}, "
            f"{result['resolution']} px) -> {args.out}"
        )
    return result


if __name__ == "__main__":
    main()
