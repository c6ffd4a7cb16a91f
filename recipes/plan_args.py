"""`python -m recipes.plan`'s command line: its options, their argparse types (each number checked as
it is read: `nan`, `inf`, 0 and negatives are one `error: argument --flag: ...` line, exit 2) and
the trailing Hydra overrides told apart from them.
"""

import argparse
import math
import re

from recipes.memory import add_memory_arguments

DEFAULT_GPUS = [8, 16, 32, 64, 128, 256]
DEFAULT_PRICE = 2.0  # $/A100-hour, the price the published mosaicml/diffusion cost figures use


def _split_overrides(argv: list[str]) -> tuple[list[str], list[str]]:
    # `--gpus 8 16 a.b=c` would otherwise hand `a.b=c` to --gpus; Hydra overrides contain `=` or
    # start with `~` (delete), options start with `-`, so they can be told apart before argparse.
    def is_override(arg):
        return not arg.startswith("-") and ("=" in arg or arg.startswith("~"))

    return [a for a in argv if not is_override(a)], [a for a in argv if is_override(a)]


def _attach_negative_numbers(options: list[str]) -> list[str]:
    """`--flag -inf` as `--flag=-inf`: argparse takes `-inf`, `-nan` or `-1e3` (any negative number but
    plain `-1` and `-0.5`) for an option of its own and answers "expected one argument", without the
    value; attached, the flag's type names it. A negative number after values of a flag that takes
    several (`--gpus 8 -inf`) goes to that flag too."""
    attached, flag = [], None
    for arg in options:
        if arg.startswith("-") and _is_number(arg) and flag is not None:
            if attached[-1] == flag:  # `--flag -inf`
                attached.pop()
            attached.append(f"{flag}={arg}")  # after the flag's other values: `--gpus 8 --gpus=-inf`
            continue
        if arg.startswith("-"):
            flag = None if "=" in arg else arg
        attached.append(arg)
    return attached


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _microbatch(value: str):
    if value == "auto":
        return value
    if not re.fullmatch(r"\s*\d+\s*", value) or int(value) < 1:
        raise argparse.ArgumentTypeError(
            f"must be auto or a whole number of samples, at least 1, got {value}"
        )
    return int(value)


def _whole(what: str):
    """An argparse type: a whole number of `what`, at least 1. Its error names the value after
    argparse's `error: argument --flag:`."""

    def parse(value: str) -> int:
        try:
            number = int(value)
        except ValueError:
            number = 0
        if number < 1:
            raise argparse.ArgumentTypeError(f"must be a whole number of {what}, at least 1, got {value}")
        return number

    parse.__name__ = f"number of {what}"
    return parse


def positive_number(what: str):
    """An argparse type: a finite number of `what` above 0 (`nan`, `inf`, 0 and below would price a run
    at nothing, or not at all). Its error names the value after argparse's `error: argument --flag:`."""

    def parse(value: str) -> float:
        try:
            number = float(value)
        except ValueError:
            number = math.nan
        if not math.isfinite(number) or number <= 0:
            raise argparse.ArgumentTypeError(f"must be a positive, finite number of {what}, got {value}")
        return number

    parse.__name__ = f"number of {what}"
    return parse


_gpu_count = _whole("GPUs")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m recipes.plan",
        description="Per-device batch, gradient accumulation, days, GPU-hours and cost of a run at several "
        "GPU counts. Assumes linear scaling (images/s per GPU constant across GPU counts), so cost is "
        "the same for every count and the days are a lower bound at large counts.",
        epilog="Trailing key=value arguments are Hydra overrides of the YAML, as for train.py.",
    )
    parser.add_argument("yaml", help="the run config, e.g. yamls/sd2-base.yaml")
    parser.add_argument(
        "--gpus",
        type=_gpu_count,
        nargs="+",
        help=f"GPU counts (world sizes; default {' '.join(map(str, DEFAULT_GPUS))}, or for a global batch "
        "under 8, as a one-GPU LoRA recipe's, the powers of two up to it)",
    )
    parser.add_argument(
        "--img-per-sec-per-gpu",
        type=positive_number("images/s per GPU"),
        help="measured training throughput per GPU",
    )
    parser.add_argument(
        "--throughput-file", help='JSON from a throughput benchmark: {"img_per_sec_per_gpu": ...}'
    )
    parser.add_argument(
        "--price-per-gpu-hour",
        type=positive_number("$ per GPU-hour"),
        default=DEFAULT_PRICE,
        help="$ per GPU-hour (default: %(default)s)",
    )
    parser.add_argument(
        "--microbatch",
        type=_microbatch,
        help="override trainer.device_train_microbatch_size (a cap: int, or auto)",
    )
    parser.add_argument(
        "--per-gpu-batch",
        type=_whole("samples per GPU"),
        help="a run to an MLPerf target: each count trains at global batch N x GPUs (MLPerf's way of "
        "scaling out), priced at that batch's samples to converge (recipes/convergence.py)",
    )
    add_memory_arguments(parser, _gpu_count, positive_number("GB"))
    parser.add_argument("--json", action="store_true", help="print a JSON list of rows instead of a table")
    parser.add_argument("--plot", help="also write a PNG of days and cost vs GPUs")
    return parser


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """The options and the trailing Hydra overrides; argparse's exit (status 2) on a bad throughput,
    or on what needs one (--plot, --per-gpu-batch) without it. Without a throughput the plan is the
    memory per GPU only (recipes/plan.py)."""
    parser = build_parser()
    options, overrides = _split_overrides(argv)
    args = parser.parse_args(_attach_negative_numbers(options))
    if args.img_per_sec_per_gpu is None and args.throughput_file is None:
        for flag, given in (("--plot", args.plot), ("--per-gpu-batch", args.per_gpu_batch)):
            if given:
                parser.error(f"{flag} needs a throughput: {NO_THROUGHPUT}")
    return args, overrides


def default_gpus(global_batch_size: int) -> list[int]:
    """The GPU counts planned when --gpus is not given: DEFAULT_GPUS, or for a batch too small to split
    over 8 (a LoRA recipe's 4 on one GPU) 1, 2, 4, ... up to it."""
    if global_batch_size >= DEFAULT_GPUS[0]:
        return DEFAULT_GPUS
    return [2**i for i in range(global_batch_size.bit_length()) if 2**i <= global_batch_size]


NO_THROUGHPUT = (
    "pass --img-per-sec-per-gpu X (e.g. 137.5 for SD2 base at 256 px on A100s) or --throughput-file "
    "bench/throughput.json written by a throughput benchmark"
)
