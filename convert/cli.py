"""The `sd-convert` / `python -m convert` command line: its sources, options and help texts.

convert/__main__.py parses with it and runs the conversion. Only light imports here, so `--help`
answers at once.
"""

import argparse
import re
import sys

from convert.images import ENCODE_FORMATS, MIN_SIDE

DESCRIPTION = """Convert image-caption data to MDS shards (mosaicml-streaming), locally or to S3.

Each input (a tar or parquet shard, or a chunk of a folder) becomes its own sub-dataset with a
completion marker; rerunning the same command skips finished inputs and redoes unfinished ones
(another source or other options on the same --out stop with an error), and the top-level
index.json, merged at the end, names only finished shards. Bad samples (truncated,
empty or non-image files, decompression bombs, unusable captions, unsafe tar paths, ...) are skipped
and counted by reason in convert-report.json, written at the top of --out (<out>/convert-report.json)."""

EPILOG = """examples:
  sd-convert folder --src photos/ --out data/photos
  sd-convert img2dataset --src laion-shards/ --out s3://bucket/laion --workers 8 --resize-max 512
  sd-convert laion --src laion-meta.parquet --out data/laion --min-aesthetic 5 --max-punsafe 0.1
  sd-convert coco --src annotations/captions_val2014.json --images val2014/ --out data/coco
  sd-convert mlperf-flux-images --src /dataset/coco --out data/coco-mlperf

S3: set S3_ENDPOINT_URL for a non-AWS endpoint and the usual AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY.
Exit status: 0 when the run finished (see the summary line for failed inputs), 1 on a fatal error
or when nothing usable was made (every input failed, or every sample was skipped)."""

SOURCES = {
    "folder": "images with a same-stem .txt (or .json with a caption field) next to each",
    "img2dataset": "a folder of img2dataset output: webdataset tars or parquet shards (auto-detected)",
    "laion": "LAION-style metadata parquet(s) with URL + caption columns: downloads with img2dataset first",
    "coco": "a COCO captions json plus its image folder",
    "latents": "an MDS image-caption set (our output) -> VAE latents + text embeddings, fp16",
    "mlperf-flux": "the MLPerf Flux.1 reference's preprocessed CC12M or COCO set -> the latents source's set",
    "mlperf-flux-images": "the MLPerf Flux.1 reference's 256 px CC12M or COCO image set, pixels kept as "
    "it made them (COCO's timesteps too)",
}


OVERWRITE_HELP = (
    "first delete what an earlier conversion wrote to --out (only that), then convert everything; "
    "without it a rerun continues the same conversion and refuses any other"
)


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _non_negative(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be at least 0, got {value}")
    return value


def _ratios(text: str) -> tuple[float, ...]:
    """'0.5,1,4:3' -> (0.5, 1.0, 1.333...)."""
    ratios = []
    for item in text.split(","):
        width, _, height = item.strip().partition(":")
        try:
            ratio = float(width) / float(height or 1)
        except (ValueError, ZeroDivisionError):
            raise argparse.ArgumentTypeError(
                f"not an aspect ratio: {item!r} (use e.g. 0.75 or 3:4)"
            ) from None
        if ratio <= 0:
            raise argparse.ArgumentTypeError(f"aspect ratios must be positive: {item!r}")
        ratios.append(ratio)
    return tuple(sorted(set(ratios)))


def _common() -> argparse.ArgumentParser:
    """The options every image source shares, in their help groups."""
    common = argparse.ArgumentParser(add_help=False)
    _run_options(common.add_argument_group("output and run"))
    _image_options(common.add_argument_group("images"))
    _filter_options(
        common.add_argument_group("filters (a sample lacking the value is skipped when its filter is set)")
    )
    _mds_options(common.add_argument_group("MDS output"))
    return common


def _run_options(run) -> None:
    run.add_argument(
        "--out", required=True, help="output folder, or s3://bucket/prefix (any S3-compatible endpoint)"
    )
    run.add_argument(
        "--workers", type=_positive, default=1, help="processes converting inputs in parallel (default 1)"
    )
    run.add_argument(
        "--work-dir",
        help="local scratch folder: laion downloads and S3 upload staging (default: a folder in the system "
        "temp dir named after --out, so reruns find it)",
    )
    run.add_argument("--overwrite", action="store_true", help=OVERWRITE_HELP)
    run.add_argument(
        "--no-progress", action="store_true", help="no progress bar (the summary line still prints)"
    )
    run.add_argument("-v", "--verbose", action="store_true", help="log every skipped sample and its reason")


def _image_options(img) -> None:
    img.add_argument(
        "--resize-max",
        type=_positive,
        metavar="SIDE",
        help="downscale so the shorter side is at most SIDE, keeping the aspect ratio; smaller images are "
        "kept as they are (default: no resize, the original bytes are stored untouched)",
    )
    img.add_argument("--center-crop", action="store_true", help="crop each image to its centred square")
    img.add_argument(
        "--encode-format",
        choices=ENCODE_FORMATS,
        default="auto",
        help="format for images that are resized or repaired (default auto: PNG for lossless sources, "
        "else JPEG)",
    )
    img.add_argument(
        "--encode-quality", type=int, default=95, help="JPEG/WebP quality for re-encoded images (default 95)"
    )
    img.add_argument(
        "--max-pixels",
        type=_positive,
        default=64_000_000,
        help="skip images with more pixels than this (decompression bombs), read from the header before "
        "decoding (default 64000000)",
    )
    img.add_argument(
        "--verify",
        choices=("header", "decode"),
        default="header",
        help="header: images kept as they are get a header and end-of-file check (catches truncation); "
        "decode: fully decode every image too (slower, also catches corrupt data) (default header)",
    )


def _filter_options(flt) -> None:
    flt.add_argument(
        "--min-side",
        type=_non_negative,
        default=MIN_SIDE,
        metavar="PX",
        help="skip images whose shorter side is below PX pixels, counted as filtered_min_side: training "
        f"would upscale them into blur (default {MIN_SIDE}; 0 keeps every image)",
    )
    flt.add_argument("--min-aesthetic", type=float, help="skip samples with an aesthetic score below this")
    flt.add_argument(
        "--max-punsafe", type=float, help="skip samples with punsafe (NSFW probability) above this"
    )
    flt.add_argument("--max-watermark", type=float, help="skip samples with pwatermark above this")
    flt.add_argument(
        "--min-similarity", type=float, help="skip samples with CLIP image-text similarity below this"
    )
    flt.add_argument(
        "--keep-empty-captions",
        action="store_true",
        help="keep samples whose caption is empty (default: skip them)",
    )


def _mds_options(mds) -> None:
    mds.add_argument(
        "--buckets",
        type=_ratios,
        metavar="RATIOS",
        help="write one sub-dataset per aspect ratio (width/height), each image to the nearest: e.g. "
        "0.5,0.75,1,4:3,2 gives <out>/ar0.75/ ... with their own index.json (default: no buckets)",
    )
    mds.add_argument(
        "--compression",
        default="none",
        help="MDS shard compression, e.g. zstd, zstd:7 (default none: encoded images do not compress, "
        "zstd saved 0-2%% of the size for twice the writing time)",
    )
    mds.add_argument(
        "--shard-size", type=_positive, default=1 << 26, help="MDS shard size limit in bytes (default 64 MiB)"
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="sd-convert",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="source", required=True, metavar="SOURCE", help="one of:")
    _image_sources(sub, _common())
    _latents_parser(sub)
    _mlperf_parser(sub)
    return parser


def _image_sources(sub, common: argparse.ArgumentParser) -> None:
    """One sub-command per image source: the common options, --src and the source's own."""

    def add(name: str, src_help: str) -> argparse._ArgumentGroup:
        p = sub.add_parser(name, parents=[common], help=SOURCES[name], description=SOURCES[name])
        p.add_argument("--src", required=True, help=src_help)
        return p.add_argument_group(f"{name} options")

    g = add("folder", "folder of images and caption files (searched recursively)")
    g.add_argument("--part-size", type=_positive, default=10_000, help="images per input (default 10000)")
    g = add("img2dataset", "folder holding img2dataset's NNNNN.tar or NNNNN.parquet shards")
    g.add_argument(
        "--format",
        choices=("auto", "webdataset", "parquet"),
        default="auto",
        help="shard format (default: auto)",
    )
    g = add("laion", "metadata parquet file, or a folder of them")
    g.add_argument("--url-col", help="URL column (default: URL or url)")
    g.add_argument("--caption-col", help="caption column (default: TEXT, caption or txt, any case)")
    g.add_argument("--threads", type=_positive, default=32, help="download threads per process (default 32)")
    g.add_argument(
        "--timeout", type=_positive, default=10, help="seconds to wait for each image (default 10)"
    )
    g.add_argument("--retries", type=int, default=0, help="download retries per image (default 0)")
    g.add_argument(
        "--download-shard-size",
        type=_positive,
        default=10_000,
        help="images per download shard (default 10000)",
    )
    g.add_argument(
        "--delete-downloads",
        action="store_true",
        help="delete the downloaded shards once every input is converted",
    )
    g = add("coco", "COCO captions json, e.g. annotations/captions_val2014.json")
    g.add_argument(
        "--images", required=True, help="the folder holding the images the json names (e.g. val2014/)"
    )
    g.add_argument("--per-caption", action="store_true", help="one row per caption instead of one per image")
    g.add_argument("--part-size", type=_positive, default=5_000, help="images per input (default 5000)")
    add(
        "mlperf-flux-images",
        "the folder the download made: /dataset/cc12m_disk (data-*.arrow) or /dataset/coco (shard_*.tar)",
    )


def _latents_parser(sub) -> None:
    lat = sub.add_parser(
        "latents",
        help=SOURCES["latents"],
        description=LATENTS_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    lat.add_argument("--src", required=True, help="local MDS folder written by one of the sources above")
    lat.add_argument("--out", required=True, help="output folder, or s3://bucket/prefix")
    lat.add_argument(
        "--resolutions", type=_positive, nargs="+", required=True, help="e.g. 256 512: one column each"
    )
    lat.add_argument("--preset", help="model preset (default sd2-base)")
    lat.add_argument(
        "--pretrained",
        help="diffusers-format folder or hub id holding the VAE and text encoder to encode with "
        "(e.g. stabilityai/stable-diffusion-2-base); without it the preset's random weights are used",
    )
    lat.add_argument(
        "--recipe",
        metavar="YAML",
        help="encode with the VAE and text encoder(s) of the model this run config trains, built as "
        "train.py builds it (its seed and model section; KEY=VALUE arguments anywhere are its overrides, "
        "as for train.py): the tiny recipes' random text encoder beside the VAE they load, e.g. "
        "yamls/tiny-cpu.yaml; in place of --preset, --pretrained and --t5",
    )
    lat.add_argument("--batch-size", type=_positive, default=16, help="images per forward pass (default 16)")
    lat.add_argument(
        "--precision",
        choices=("fp32", "bf16"),
        help="the encoders' weights and compute (default: bf16 for a flux preset, as the MLPerf Flux.1 "
        "reference encodes, else fp32); the columns are fp16 either way",
    )
    lat.add_argument(
        "--t5",
        action="store_true",
        help="an mmdit preset (sd3-medium): also store T5's context (text_embeds_3) from --pretrained's "
        "text_encoder_3/; train with model.pretrained_components naming text_encoder_3 (default: off, "
        "as the recipes train; always on for mmdit-tiny-t5, whose own T5 needs no --pretrained)",
    )
    lat.add_argument(
        "--device",
        help="torch device (default: with GPUs, one per process: cuda:i for the i-th; else cpu)",
    )
    lat.add_argument(
        "--workers",
        type=_positive,
        default=1,
        help="processes encoding inputs in parallel, per rank of composer -n (default 1)",
    )
    lat.add_argument(
        "--work-dir", help="local scratch folder: S3 upload staging (default: in the system temp dir)"
    )
    lat.add_argument("--overwrite", action="store_true", help=OVERWRITE_HELP)
    lat.add_argument("--no-progress", action="store_true", help="no progress bar")
    lat.add_argument("-v", "--verbose", action="store_true", help="debug logging")


def _mlperf_parser(sub) -> None:
    p = sub.add_parser("mlperf-flux", help=SOURCES["mlperf-flux"], description=MLPERF_DESCRIPTION,
                       formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument(
        "--src",
        required=True,
        help="the folder of data-*.arrow files (datasets' save_to_disk) the download made",
    )
    p.add_argument("--out", required=True, help="output folder, or s3://bucket/prefix")
    p.add_argument(
        "--empty-encodings",
        help="the folder holding t5_empty.npy and clip_empty.npy (flux-1-empty-encodings), written beside "
        "index.json for caption dropout",
    )
    p.add_argument(
        "--preset", default="flux-schnell", help="the flux preset the set is for (default %(default)s)"
    )
    p.add_argument("--workers", type=_positive, default=1, help="processes converting files in parallel")
    p.add_argument(
        "--work-dir", help="local scratch folder: S3 upload staging (default: in the system temp dir)"
    )
    p.add_argument("--overwrite", action="store_true", help=OVERWRITE_HELP)
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")


MLPERF_DESCRIPTION = """Convert the MLPerf Flux.1 reference's preprocessed data (mlcommons/training
text_to_image README, "Preprocessing": flux-1-cc12m-preprocessed, flux-1-coco-preprocessed and
flux-1-empty-encodings) into the set `sd-convert latents --preset flux-schnell` writes: latents_256
(the VAE's mean and logvar), text_embeds (T5) and pooled_text_embeds (CLIP), bf16 stored as fp16
(exact for magnitudes 2^-14 .. 65504, rounded below; rows beyond are skipped), and for the COCO
set each sample's eval_timestep, which validation uses. One input per Arrow file, restartable like
every source:
  sd-convert mlperf-flux --src /dataset/coco_preprocessed --out s3://bucket/coco-flux \
      --empty-encodings /dataset/empty_encodings
  sd-convert mlperf-flux --src /dataset/cc12m_preprocessed --out s3://bucket/cc12m-flux --workers 16 \
      --empty-encodings /dataset/empty_encodings"""


LATENTS_DESCRIPTION = """Run the frozen VAE and text encoder over an MDS image-caption set once and write
latents_{R} (posterior mean + logvar, unscaled) per resolution and text_embeds, fp16. Train on them
with data.train.latents=true; the model samples and scales the latents itself.

Each input of the source set (<src>/[<bucket>/]NAME/) becomes the same sub-dataset under --out, with
a completion marker: rerunning the same command skips finished inputs and redoes the others, and the
merged index.json names finished ones only. A bucketed set keeps its buckets, each encoded at its own
size. Several processes share the inputs, one GPU each when there are GPUs:
  sd-convert latents --src data/laion --out s3://bucket/laion-latents --resolutions 256 --workers 8
  composer -n 8 -m convert latents --src data/laion --out data/laion-latents --resolutions 256
With a VAE-only folder (the tiny VAE's export), the recipe that trains on it gives the text encoder:
  sd-convert latents --src runs/data/shapes --out runs/data/shapes-latents --resolutions 32 \
      --recipe yamls/tiny-cpu.yaml"""


# A Hydra override of a --recipe (`seed=3`, `model.pretrained=x`, `~key`, `+key=v`): told apart from
# option values before argparse, which would give `--resolutions 32 seed=3` the override as a size.
OVERRIDE = re.compile(r"^(~[\w.]+|[+~]*[A-Za-z_][\w.]*=.*)$")


def parse_args(argv=None) -> argparse.Namespace:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    latents = argv[:1] == ["latents"]
    overrides = [arg for arg in argv[1:] if OVERRIDE.match(arg)] if latents else []
    args = parser.parse_args([arg for arg in argv if arg not in overrides])
    args.overrides = overrides
    if getattr(args, "center_crop", False) and args.buckets:
        parser.error("--center-crop makes every image square, so --buckets would have nothing to sort")
    if args.source == "latents":
        given = [flag for flag, value in (("--preset", args.preset), ("--pretrained", args.pretrained),
                                          ("--t5", args.t5)) if value]  # fmt: skip
        if args.recipe and given:
            parser.error(f"--recipe gives the model: drop {', '.join(given)}")
        if args.overrides and not args.recipe:
            parser.error(f"{args.overrides[0]}: KEY=VALUE overrides apply to a --recipe; give one")
        args.preset = args.preset or "sd2-base"
    return args
