"""Plan a run at several GPU counts: batch split, images seen, days, GPU-hours and cost.

    python -m recipes.plan yamls/RUN.yaml --gpus 8 16 32 64 128 256 --img-per-sec-per-gpu 137.5 \
        [--price-per-gpu-hour 2] [--microbatch N|auto] [--gpu-memory 80] [--shard 1 2 4 8] \
        [--json] [--plot plan.png] [key=value ...]

The YAML gives the global batch, `trainer.max_duration` (in batches, `550000ba`, or samples, `Nsp`)
and `trainer.device_train_microbatch_size`; nothing in it depends on the GPU count. Throughput
comes from `--img-per-sec-per-gpu` or from `--throughput-file`, a JSON file a throughput benchmark
writes with `write_throughput`:

    {"img_per_sec_per_gpu": 137.5, "resolution": 256, "device": "8x A100-40GB", ...}

Only `img_per_sec_per_gpu` is required; `resolution` is checked against `data.train.resolution`.
Without either, the planner prints the memory per GPU alone (below), e.g. which frozen base of a LoRA
recipe fits a 24 GB card: `python -m recipes.plan yamls/flux-lora.yaml --gpus 1 --gpu-memory 24`.

The rate is used as given, for whatever model the YAML trains. Above the table the planner says
which preset the rate was measured on, when it knows (a throughput file records its recipe's
`preset`), and notes a rate used for another preset; a rate given with `--img-per-sec-per-gpu`
for any preset but sd2-base gets a note too: this repo has measured only SD2 base's rate (the
published 137.5 img/s per A100 and its own H100 figures), so sdxl-base (a 2.6 B UNet at 1024 px) or
sd3-medium planned with it are SD2's rate, not theirs, and their days and cost are lower bounds.

Linear scaling is assumed: images/s per GPU is the same at every GPU count, so GPU-hours and cost
are the same for every row and only the days shrink. Real scaling is worse: the published SD2 base
figures (mosaicml/diffusion, 256 px) are 1,100 img/s on 8 A100s (137.5 per GPU) but 11,600 on 128
(90.6 per GPU, 66% of linear). Treat the days and cost as lower bounds at large counts.

`trainer.device_train_microbatch_size` is a cap (recipes/scaling.py): each row shows the
microbatch a run at that count uses, the largest divisor of its per-device batch not above the cap.
A GPU count whose batch split fails (the world size does not divide the global batch) is reported
on its row, with `error` in JSON and no days, GPU-hours or cost; the rest of the table is still
printed and the planner exits with status 1, so a script that checks a recipe stops there.

Below it, memory per GPU at each count and sharding shape (the run's own, or `--shard`'s), by part
(recipes/memory.py); a shape over `--gpu-memory` is marked NO, a line names the smallest shard that
fits, and a count where no shape fits also makes the exit status 1. A LoRA run's shapes also come
with each other way to store its frozen base (`model.base_weights`: fp32, bf16, and on a transformer
fp8 and nf4; recipes/memory_bases.py), marked `(if)`, and a line names those that fit.
"""

import json
import logging
import math
import re
import sys
from dataclasses import asdict

from omegaconf import OmegaConf

from recipes.compose import load_config
from recipes.config import ConfigError, parse_config
from recipes.convergence import benchmark_of, converging_rows, describe, no_benchmark
from recipes.memory import format_memory
from recipes.memory_advice import plan_memory
from recipes.plan_args import NO_THROUGHPUT, build_parser, default_gpus, parse_args  # noqa: F401 - build_parser: tests, --help
from recipes.plan_plot import write_plot
from recipes.scaling import plan_batches
from recipes.throughput import Throughput, rate_note, read_throughput, write_throughput

__all__ = ["Throughput", "main", "plan_rows", "rate_note", "read_throughput", "write_throughput"]

log = logging.getLogger(__name__)

ROW_KEYS = ["gpus", "per_device_batch", "microbatch", "grad_accum", "images", "days", "gpu_hours", "cost"]
ROW_KEYS += ["memory"]  # one dict per sharding shape: recipes/memory_advice.py plan_memory, called by main


def images_to_see(max_duration, global_batch_size: int) -> int:
    """Images one run sees: batches x global batch, or the sample count itself."""
    match = re.fullmatch(r"\s*(\d+)\s*(ba|sp)\s*", str(max_duration))
    if not match:
        # Epochs (an int, or "Nep") need the dataset size, which the config does not state.
        raise ConfigError(
            f"trainer.max_duration={max_duration!r}: the planner needs it in batches (e.g. 550000ba) "
            f"or samples (e.g. 1126400000sp)"
        )
    count, unit = int(match[1]), match[2]
    return count * global_batch_size if unit == "ba" else count


def plan_rows(
    global_batch_size: int,
    max_duration,
    microbatch,
    gpus: list[int],
    img_per_sec_per_gpu: float | None,
    price: float,
) -> list[dict]:
    """One dict per GPU count with ROW_KEYS, plus `error` where the batch split fails (its days,
    GPU-hours and cost are then None: no such run exists to cost; also None without a throughput)."""
    images = images_to_see(max_duration, global_batch_size)
    rows = []
    for n in gpus:
        row = dict.fromkeys(ROW_KEYS)
        row.update(gpus=n, images=images)
        if img_per_sec_per_gpu is not None:
            # Linear scaling: the run costs the same GPU-seconds at every count.
            gpu_hours = images / img_per_sec_per_gpu / 3600
            row.update(days=gpu_hours / n / 24, gpu_hours=gpu_hours, cost=gpu_hours * price)
        try:
            row.update(asdict(plan_batches(global_batch_size, n, microbatch)))
        except ConfigError as err:
            row.update(days=None, gpu_hours=None, cost=None, error=str(err))
        rows.append(row)
    return rows


def format_table(rows: list[dict]) -> str:
    header = ["GPUs", "per-device batch", "microbatch", "grad accum", "images", "days", "GPU-hours", "cost"]

    def cells(row):
        def dash(value):
            return "-" if value is None else str(value)

        if "error" in row:  # the message follows the table
            images = "-" if row["images"] is None else f"{row['images']:,}"  # None: no samples to converge
            return [str(row["gpus"]), "-", "-", "error", images, "-", "-", "-"]
        return [
            str(row["gpus"]),
            dash(row["per_device_batch"]),
            dash(row["microbatch"]),
            "auto" if row["microbatch"] == "auto" else str(row["grad_accum"]),
            f"{row['images']:,}",
            f"{row['days']:.2f}",
            f"{row['gpu_hours']:,.1f}",
            f"${row['cost']:,.0f}",
        ]

    table = [header] + [cells(row) for row in rows]
    widths = [max(len(line[i]) for line in table) for i in range(len(header))]
    lines = ["  ".join(cell.rjust(w) for cell, w in zip(line, widths)) for line in table]
    lines += [f"error at {row['gpus']} GPUs: {row['error']}" for row in rows if "error" in row]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    """Print the plan; exit with status 1 when a GPU count's batch split fails or no shape of it fits
    (status 2: bad arguments, as argparse)."""
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    args, overrides = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        cfg = load_config(args.yaml, overrides)
        # Planning needs no bucket or save folder: fill the `???` keys only a real run must set.
        for key in OmegaConf.missing_keys(cfg):
            OmegaConf.update(cfg, key, "unset-for-planning")
        run = parse_config(cfg)
        args.gpus = args.gpus or default_gpus(run.global_train_batch_size)
        if args.img_per_sec_per_gpu is not None:  # the flag wins over the file
            throughput = Throughput(args.img_per_sec_per_gpu)
        elif args.throughput_file is None:  # the memory per GPU only
            throughput = None
        else:
            throughput = read_throughput(args.throughput_file)
            if not math.isfinite(throughput.img_per_sec_per_gpu):  # JSON's NaN and Infinity
                raise ConfigError(
                    f"throughput file {args.throughput_file} needs a positive 'img_per_sec_per_gpu', got "
                    f"{throughput.img_per_sec_per_gpu}"
                )
        microbatch = (
            run.trainer.get("device_train_microbatch_size") if args.microbatch is None else args.microbatch
        )
        max_duration = run.trainer.get("max_duration")
        rate = (throughput and throughput.img_per_sec_per_gpu, args.price_per_gpu_hour)
        bench = benchmark_of(run)  # a run to an MLPerf target: its samples to converge, not max_duration
        if bench is None:
            if args.per_gpu_batch:
                raise ConfigError(f"--per-gpu-batch: {args.yaml} trains to {no_benchmark()}")
            rows = plan_rows(run.global_train_batch_size, max_duration, microbatch, args.gpus, *rate)
        else:
            per_gpu = args.per_gpu_batch
            batch = {n: per_gpu * n if per_gpu else run.global_train_batch_size for n in args.gpus}
            rows = converging_rows(bench, plan_rows, batch, microbatch, *rate)
        memory_notes, no_fit = plan_memory(run, rows, args.shard, args.gpu_memory, args.gpus_per_node)
    except ConfigError as err:
        sys.exit(f"config error: {err}")
    if throughput is None:
        _print_memory_only(args, run, rows, memory_notes, max_duration)
        if no_fit or any("error" in row for row in rows):
            sys.exit(1)
        return
    note = rate_note(run.model["preset"], throughput)
    if note is not None and args.json:  # the table prints it above the rows
        log.warning("%s", note)
    if throughput.resolution is not None and throughput.resolution != run.data.train.resolution:
        log.warning(
            "throughput in %s was measured at %s px but data.train.resolution is %s px",
            throughput.source,
            throughput.resolution,
            run.data.train.resolution,
        )

    images = next((row["images"] for row in rows if row["images"] is not None), 0)
    title = f"{run.run_name}: {images:,} images at {throughput.img_per_sec_per_gpu:g} img/s per GPU"
    if args.plot:
        write_plot(rows, args.plot, title)
    failed = no_fit or any("error" in row for row in rows)
    if args.json:
        for line in memory_notes:
            log.warning("%s", line)
        print(json.dumps(rows, indent=2))
        if failed:
            sys.exit(1)
        return
    shown = f"global batch {run.global_train_batch_size}, max_duration {max_duration}"
    if bench is not None:
        per_gpu = f"{args.per_gpu_batch} x GPUs" if args.per_gpu_batch else run.global_train_batch_size
        shown = f"global batch {per_gpu}, to {bench.name}'s target {bench.target:g}"
    _print_assumptions(args, run, throughput, shown, microbatch, None if args.per_gpu_batch else images, note)
    if bench is not None:
        print("\n".join(describe(bench, run, rows, list(batch.values()))))
    print()
    print(format_table(rows))
    print()
    print("\n".join([format_memory(rows, args.gpu_memory), *memory_notes]))
    if failed:
        sys.exit(1)


def _print_memory_only(args, run, rows: list[dict], memory_notes: list[str], max_duration) -> None:
    """No throughput given: the rows as JSON, or the memory table with the batch split it assumes."""
    if args.json:
        for line in memory_notes:
            log.warning("%s", line)
        print(json.dumps(rows, indent=2))
        return
    print(f"{args.yaml}: preset {run.model['preset']}, global batch {run.global_train_batch_size}")
    print(f"no throughput given: memory per GPU only; for days and cost {NO_THROUGHPUT}")
    print()
    print("\n".join([format_memory(rows, args.gpu_memory), *memory_notes]))
    splits = [f"error at {row['gpus']} GPUs: {row['error']}" for row in rows if "error" in row]
    if splits:
        print("\n".join(splits))


def _print_assumptions(
    args, run, throughput: Throughput, shown: str, microbatch, images: int | None, note: str | None
) -> None:
    """The lines above the table: what the plan starts from (run, throughput and the preset it was
    measured on, price, microbatch cap); `shown`: its batch and duration; images None: each row's own."""
    device = f" on {throughput.device}" if throughput.device else ""
    measured = f", measured on preset {throughput.preset}" if throughput.preset else ""
    seen = "each row's images" if images is None else f"{images:,} images"
    print(f"{args.yaml}: preset {run.model['preset']}, {shown} -> {seen}")
    print(
        f"throughput {throughput.img_per_sec_per_gpu:g} img/s per GPU{device} (from {throughput.source}"
        f"{measured}), ${args.price_per_gpu_hour:g} per GPU-hour"
    )
    if note is not None:
        print(note)
    print(
        "assumes linear scaling: img/s per GPU is the same at every GPU count, so GPU-hours and cost do "
        "not change with it; at large counts real days and cost are higher"
    )
    if microbatch not in (None, "auto"):
        print(
            f"microbatch: at most {microbatch} (trainer.device_train_microbatch_size), the largest divisor "
            "of the per-device batch not above it"
        )


if __name__ == "__main__":
    main()
