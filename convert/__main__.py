"""`python -m convert SOURCE --src ... --out DIR_OR_S3_URI [options]` (also the `sd-convert` console script).

Parses the command line (convert/cli.py), then runs the conversion it names; the heavy imports
(streaming pulls in torch) wait until after parsing, so `--help` answers at once.
"""

import logging
import shutil
import sys
from pathlib import Path

from convert.cli import parse_args

# Source options that change what gets written: recorded with the output (convert.identity), so a
# rerun with other values is refused. The others (threads, timeouts, ...) change how, not what.
SETTINGS = {
    "folder": ("part_size",),
    "img2dataset": ("format",),
    "laion": ("url_col", "caption_col", "download_shard_size"),
    "coco": ("images", "per_caption", "part_size"),
    "mlperf-flux-images": (),
}


def settings(args) -> dict:
    values = {key: getattr(args, key) for key in SETTINGS[args.source]}
    if "images" in values:
        values["images"] = str(Path(values["images"]).expanduser().resolve())
    return values


def columns(args) -> dict:
    from convert import coco, mlperf_flux_images
    from convert.common import BASE_COLUMNS, LAION_COLUMNS

    if args.source == "mlperf-flux-images":
        return mlperf_flux_images.columns(args.src)
    return {"folder": BASE_COLUMNS, "coco": coco.COLUMNS}.get(args.source, {**BASE_COLUMNS, **LAION_COLUMNS})


def inputs(args, work_dir: Path):
    """The chosen source's inputs."""
    from convert import coco, folder, img2dataset_src, laion, mlperf_flux_images

    if args.source == "mlperf-flux-images":
        return mlperf_flux_images.parts(args.src)
    if args.source == "folder":
        return folder.parts(args.src, args.part_size)
    if args.source == "coco":
        return coco.parts(args.src, args.images, args.per_caption, args.part_size)
    if args.source == "img2dataset":
        return img2dataset_src.parts(args.src, args.format)
    staging = work_dir / "downloads"
    return laion.parts(
        args.src, staging, args.url_col, args.caption_col, args.workers, args.threads, args.timeout,
        args.retries, args.download_shard_size,
    )  # fmt: skip


def options(args):
    from convert.images import ImageOptions
    from convert.samples import Options

    image = ImageOptions(
        resize_max=args.resize_max,
        center_crop=args.center_crop,
        encode_format=args.encode_format,
        encode_quality=args.encode_quality,
        max_pixels=args.max_pixels,
        min_side=args.min_side,
        verify=args.verify,
    )
    return Options(
        image=image,
        min_aesthetic=args.min_aesthetic,
        max_punsafe=args.max_punsafe,
        max_watermark=args.max_watermark,
        min_similarity=args.min_similarity,
        keep_empty_captions=args.keep_empty_captions,
        buckets=args.buckets or (),
        compression=None if args.compression == "none" else args.compression,
        shard_size_limit=args.shard_size,
    )


# This repo's top-level packages (setup.py): what -v turns to DEBUG.
OUR_PACKAGES = ("common", "convert", "data", "demo", "evaluation", "extensions", "models", "recipes")


def configure_logging(verbose: bool) -> None:
    """INFO for everything; with -v, DEBUG for this repo's loggers only. DEBUG on the root logger
    would also turn on every library's (PIL alone logs 50+ lines of plugin imports)."""
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if verbose:
        for package in OUR_PACKAGES:
            logging.getLogger(package).setLevel(logging.DEBUG)


def main(argv=None) -> int:
    args = parse_args(argv)
    configure_logging(args.verbose)
    from convert.common import ConvertError
    from convert.identity import check, record
    from convert.pipeline import convert, default_work_dir
    from convert.storage import open_store

    if args.source == "latents":
        return _latents(args)
    if args.source == "mlperf-flux":
        return _mlperf_flux(args)
    work_dir = Path(args.work_dir).expanduser() if args.work_dir else default_work_dir(args.out)
    opts = options(args)
    try:
        cols = columns(args)
        # before any download or source listing: bad credentials or a wrong --out should cost seconds
        store = open_store(args.out)
        store.check()
        check(
            store,
            record(args.source, args.src, settings(args), opts, cols, opts.digest(cols), ()),
            args.overwrite,
        )
        parts = inputs(args, work_dir)
        report = convert(
            parts, args.out, opts, cols, source=args.source, src=args.src, settings=settings(args),
            workers=args.workers, work_dir=work_dir, progress=not args.no_progress, overwrite=args.overwrite,
        )  # fmt: skip
    except ConvertError as err:
        print(f"sd-convert: error: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("sd-convert: interrupted; run the same command again to resume", file=sys.stderr)
        return 130
    if args.source == "laion" and args.delete_downloads and report["complete"]:
        shutil.rmtree(work_dir / "downloads", ignore_errors=True)
    return _finished(report)


def _finished(report: dict) -> int:
    """Print the summary line; 1 with an error line when the run produced nothing usable."""
    from convert.report import run_failure, summary_line

    print(summary_line(report))
    if failure := run_failure(report):
        print(f"sd-convert: error: {failure}", file=sys.stderr)
        return 1
    return 0


def _latents(args) -> int:
    from convert.common import ConvertError
    from convert.encoders import recipe_model
    from convert.latents import convert_latents
    from convert.ranks import launched_group

    try:
        recipe = recipe_model(args.recipe, args.overrides) if args.recipe else None
    except ConvertError as err:  # the recipe's own mistake
        print(f"sd-convert: error: --recipe {args.recipe}: {err}", file=sys.stderr)
        return 1
    group = launched_group()  # the ranks of composer -n N / torchrun, or this process alone
    try:
        report = convert_latents(
            args.src, args.out, args.resolutions, args.preset, args.pretrained, args.batch_size, args.device,
            workers=args.workers, work_dir=args.work_dir, progress=not args.no_progress,
            overwrite=args.overwrite, group=group, t5=args.t5, recipe=recipe, precision=args.precision,
        )  # fmt: skip
    except (ConvertError, OSError, ValueError) as err:
        print(f"sd-convert: error: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("sd-convert: interrupted; run the same command again to resume", file=sys.stderr)
        return 130
    finally:
        group.close()
    return _finished(report)


def _mlperf_flux(args) -> int:
    from convert.common import ConvertError
    from convert.mlperf_flux import convert_mlperf_flux

    try:
        report = convert_mlperf_flux(
            args.src, args.out, args.empty_encodings, args.preset, workers=args.workers,
            work_dir=args.work_dir, progress=not args.no_progress, overwrite=args.overwrite,
        )  # fmt: skip
    except ConvertError as err:
        print(f"sd-convert: error: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("sd-convert: interrupted; run the same command again to resume", file=sys.stderr)
        return 130
    return _finished(report)


if __name__ == "__main__":
    sys.exit(main())
