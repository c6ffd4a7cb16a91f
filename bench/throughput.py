"""Training throughput of a recipe on this machine, written where `recipes.plan` reads it.

    python bench/throughput.py yamls/sd2-base.yaml --batches 30 --warmup 10 [key=value ...] \
        --out bench/throughput.json
    python -m recipes.plan yamls/sd2-base.yaml --throughput-file bench/throughput.json

Trains the recipe for `--warmup + --batches` batches on synthetic data (the demo's shapes, resized
to the recipe's resolution; nothing is downloaded, and data loading is not what is measured) and
reports images/s per device over the timed batches: the global batch times batches per second,
divided by the number of processes. Run it under `composer -n GPUS` on one node to measure what a
node does; all ranks read one data folder (`--data`, made on first use). Random weights are fine for
speed, so `model.pretrained` is dropped. Checkpointing, autoresume, algorithms (EMA) and loggers are
switched off.

Per-device throughput hardly depends on gradient accumulation, so on fewer GPUs than the recipe
was written for, shrink the global batch (`global_train_batch_size=64` on one GPU with microbatch
8: eight accumulation steps a batch) instead of waiting minutes per batch.

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

from recipes import build_trainer, load_config  # noqa: E402
from recipes.plan import write_throughput  # noqa: E402


class BatchClock(Callback):
    """Wall time at the end of every batch (after the optimizer step, synchronised on GPUs)."""

    def __init__(self):
        self.ends: list[float] = []

    def batch_end(self, state: State, logger: Logger) -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self.ends.append(time.perf_counter())


def device_name() -> str:
    if torch.cuda.is_available():
        return torch.cuda.get_device_name()
    return f"cpu ({torch.get_num_threads()} threads)"


def measure(yaml_path: str, batches: int, warmup: int, overrides: list[str], data_dir: str) -> dict:
    overrides = [
        f"data.train.local={data_dir}",
        "data.train.remote=null",
        "data.train.prepare=shapes",
        "data.eval=null",
        "model.pretrained=null",
        "prepare_pretrained=null",
        f"trainer.max_duration={warmup + batches}ba",
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
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    clock = BatchClock()
    trainer.state.callbacks.append(clock)  # engine runs state.callbacks at every event
    trainer.fit()
    timed = clock.ends[warmup - 1 :] if warmup > 0 else clock.ends
    seconds = timed[-1] - timed[0]
    batches_per_s = (len(timed) - 1) / seconds
    global_batch = int(trainer.state.dataloader.batch_size) * dist.get_world_size()
    algorithms = [type(a).__name__ for a in trainer.state.algorithms]
    loggers = [type(d).__name__ for d in trainer.logger.destinations]
    trainer.close()
    return {
        "img_per_sec_per_gpu": batches_per_s * global_batch / dist.get_world_size(),
        "batches_per_sec": batches_per_s,
        "resolution": resolution,
        "global_batch": global_batch,
        "world_size": dist.get_world_size(),
        "device": device_name(),
        "timed_batches": len(timed) - 1,
        "peak_memory_gb": torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None,
        "recipe": str(yaml_path),
        "algorithms": algorithms,
        "loggers": loggers,
        "overrides": overrides,
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
    args = parser.parse_intermixed_args(argv)  # overrides may follow the options
    if args.batches < 1 or args.warmup < 1:
        parser.error("--batches and --warmup must be at least 1")
    logging.basicConfig(level=logging.WARNING)
    result = measure(args.yaml, args.batches, args.warmup, args.overrides, args.data)
    if dist.get_global_rank() == 0:
        write_throughput(args.out, **result)
        print(
            f"{result['img_per_sec_per_gpu']:.2f} img/s per device "
            f"({result['batches_per_sec']:.3f} batches/s, "
            f"global batch {result['global_batch']}, {result['world_size']} x {result['device']}, "
            f"{result['resolution']} px) -> {args.out}"
        )
    return result


if __name__ == "__main__":
    main()
