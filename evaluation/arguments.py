"""evaluation.evaluate's command line: its flags, the protocols' settings, and the checks of every
flag that take milliseconds (numbers, weights files, the source, the data's index), made before
anything loads. The evaluation itself is evaluation/evaluate.py, whose docstring is the help text.
"""

import argparse
from pathlib import Path

from evaluation import extractors
from evaluation.image_metrics import MIN_IMAGES, too_few
from models.cli_checks import UsageError, check_count, check_guidance, check_guidance_rescale
from models.engine.objectives import SAMPLERS
from models.export import add_weight_args
from models.generate import check_source

# sampler None: the model family's (models.generate.sampler_for); resolution None: the model's size.
DEFAULTS = dict(n=30_000, guidance=[8.0], steps=50, sampler=None, resolution=None, seed=2023)
PROTOCOLS = {  # MLPerf Training v4.x, stable_diffusion reference (mlcommons/training)
    "mlperf": dict(DEFAULTS, resolution=512, targets={"fid": 90.0, "clip_score": 0.15}),
}


def parse_args(argv: list[str] | None, prog: str, description: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog=prog, description=description, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("source", help="a Composer checkpoint file or an exported pipeline folder")
    parser.add_argument("--data", required=True, help="MDS image-caption set: a folder or s3://... URL")
    parser.add_argument("--out", required=True, type=Path, help="folder for images and metrics")
    parser.add_argument("--protocol", choices=sorted(PROTOCOLS), help="a published protocol's settings")
    parser.add_argument(
        "--n",
        "--num-captions",
        dest="n",
        type=int,
        help=f"captions to sample (default {DEFAULTS['n']}); under composer -n write --num-captions "
        "(composer's launcher takes --n as an abbreviation of its own options)",
    )
    parser.add_argument("--guidance", type=float, nargs="+", help="guidance scales (default 8)")
    parser.add_argument("--steps", type=int, help=f"sampling steps (default {DEFAULTS['steps']})")
    parser.add_argument(
        "--sampler", choices=sorted(SAMPLERS), help="default: the model's (ddim; euler for an mmdit model)"
    )
    parser.add_argument(
        "--guidance-rescale", type=float, help="default: 0.7 for a zero-terminal-SNR model, else 0"
    )
    parser.add_argument("--resolution", type=int, help="pixels (default: the model's size)")
    parser.add_argument("--seed", type=int, help=f"row choice and noise (default {DEFAULTS['seed']})")
    parser.add_argument("--batch-size", type=int, default=8, help="images per forward pass per process")
    parser.add_argument("--extractors", choices=("real", "tiny"), default="real")
    parser.add_argument("--inception-weights", help=f"torch-fidelity's {extractors.INCEPTION_FILE}")
    parser.add_argument("--clip-model", help="open_clip weights file or folder (see --clip-arch)")
    parser.add_argument("--clip-arch", default=extractors.CLIP_ARCH, help="open_clip architecture")
    parser.add_argument("--caption-key", default="caption")
    parser.add_argument("--image-key", default="image")
    parser.add_argument("--cache", help="local cache for a remote --data (default DIR/data-cache)")
    add_weight_args(parser)
    args = parser.parse_args(argv)
    settings = PROTOCOLS.get(args.protocol, DEFAULTS)
    for key, default in settings.items():  # flags given explicitly win over the protocol
        if getattr(args, key, None) is None:
            setattr(args, key, default)
    args.targets = settings.get("targets")
    return args


def check_numbers(args) -> None:
    """The numbers' ranges (UsageError naming the flag), before anything is read."""
    for flag, value in (("--steps", args.steps), ("--batch-size", args.batch_size)):
        check_count(flag, value)
    check_count("--resolution", args.resolution)  # None: the model's size
    check_count("--num-captions", args.n)
    if problem := too_few(args.n):
        raise UsageError(f"--num-captions {args.n}: {problem}; give --num-captions {MIN_IMAGES} or more")
    for guidance in args.guidance:
        check_guidance("--guidance", guidance)
    check_guidance_rescale("--guidance-rescale", args.guidance_rescale)


def check_inputs(args) -> None:
    """Every file the run needs is there, checked in milliseconds before anything loads: the CLIP
    weights (4 GB for ViT-H) and the checkpoint (gigabytes for SD2) would otherwise load first and a
    mistyped --data show only after them. Numbers first, weights, then the source, then the data."""
    check_numbers(args)
    if args.extractors == "real":
        extractors.check_weights(args.inception_weights, args.clip_model, args.clip_arch)
    check_source(args.source, args.ema)
    data_location(args)
    if args.out.exists() and not args.out.is_dir():
        raise FileNotFoundError(f"--out {args.out} is a file, not a folder")


def data_location(args) -> tuple[str | None, str]:
    """(remote, local) of --data; a local folder must hold an MDS index (a remote one is read when
    the set opens: that costs a download)."""
    remote = args.data if "://" in args.data else None
    local = (args.cache or str(args.out / "data-cache")) if remote else args.data
    if not remote and not (Path(local) / "index.json").is_file():
        raise FileNotFoundError(f"--data {args.data}: no MDS index.json there")
    return remote, local
