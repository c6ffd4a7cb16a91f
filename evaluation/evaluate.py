"""FID, KID and CLIP score of a checkpoint (or exported pipeline) on an MDS image-caption set.

    python -m evaluation.evaluate CHECKPOINT_OR_PIPELINE_DIR --data MDS_DIR_OR_S3 --out DIR \\
        [--n 30000] [--guidance 3 5 8] [--steps 50] [--sampler ddim|euler|dpm++] \\
        [--resolution 512] [--seed 2023] [--inception-weights PATH] [--clip-model PATH] \\
        [--extractors real|tiny] [--protocol mlperf]
    composer -n 8 -m evaluation.evaluate ... --num-captions 30000   # split across 8 processes

One image per caption of `--n` rows of the set (all rows when it has fewer; otherwise drawn with
`--seed`), for each guidance scale. The image of row i starts from noise seeded with seed + i, and
batches are dealt to ranks in turn, so any number of processes gives the same images and metrics.
Images are kept as DIR/images/guidance-G/ROW.png: a rerun (after a kill, or with more guidance
scales) reuses them. FID and KID compare Inception features of the generated images with those of
the rows' own images (resized and center-cropped to the resolution); CLIP score is the mean cosine
similarity of each image with its caption. Writes DIR/metrics.json, DIR/metrics.md,
DIR/fid-vs-clip.png and DIR/samples.png (the first images, a row per guidance scale). The sampler
defaults to the model family's (ddim for SD and SDXL; euler, its only one, for an mmdit model), the
resolution to the model's native size; checkpoints and exported folders of every family evaluate.

`--protocol mlperf`: MLPerf Training's Stable Diffusion settings (30,000 captions drawn with seed
2023, DDIM 50 steps, guidance 8, 512 px; targets FID <= 90, CLIP score >= 0.15) on the set given,
e.g. COCO-2014 val written by `sd-convert coco` (an mmdit model samples with its Euler steps).
`--extractors tiny`: random stand-in networks (evaluation/extractors.py) for tests and the CPU demo;
their numbers are not comparable to papers'.

Fewer than 10 images per guidance scale (--num-captions, or the rows of --data) are refused before
anything loads or samples (evaluation/image_metrics.py says why); rows on fewer images than the usual
protocol's minimums are marked `small_n` in metrics.json and with a footnote in metrics.md. Numbers out
of range (--guidance below 0, --steps 0, ...) and a --resolution that is not a multiple of the model's
VAE factor (x the patch size for an mmdit model) are one line before any sampling, too.
"""

import argparse
import io
import json
import logging
import random
from pathlib import Path

import torch
from composer.utils import dist, get_device
from PIL import Image
from torchvision import transforms
from torchvision.utils import save_image
from tqdm import tqdm

from common.atomic import atomic_path, atomic_write_bytes
from compat.composer import torch_device as compat_torch_device
from evaluation import arguments, extractors
from evaluation.arguments import check_inputs, data_location
from evaluation.image_metrics import scores, too_few, write_report
from models.checkpoints.checkpoint_file import one_line_errors
from models.checkpoints.sharded_checkpoint import METADATA, is_sharded_checkpoint
from models.cli_checks import UsageError, check_sampling_args
from models.generate import SamplerError, load_model, sampler_for

log = logging.getLogger("evaluation.evaluate")  # not "__main__" under python -m

SAMPLE_COLUMNS = 8  # images per guidance scale in samples.png
PROG = "python -m evaluation.evaluate"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return arguments.parse_args(argv, PROG, __doc__)


def open_dataset(args):
    from data.streaming_base import StreamingBase

    remote, local = data_location(args)
    return StreamingBase(remote=remote, local=local, shuffle=False, batch_size=1)


def choose_rows(size: int, n: int, seed: int) -> list[int]:
    """Every row when the set has at most `n`, else `n` drawn with `seed`, in row order."""
    return list(range(size)) if n >= size else sorted(random.Random(seed).sample(range(size), n))


def real_image(sample: dict, key: str, resolution: int) -> torch.Tensor:
    image = sample[key]
    if isinstance(image, bytes):
        image = Image.open(io.BytesIO(image))
    crop = transforms.Compose([transforms.Resize(resolution), transforms.CenterCrop(resolution)])
    return transforms.functional.pil_to_tensor(crop(image.convert("RGB")))


def to_uint8(images: torch.Tensor) -> torch.Tensor:
    return (images.clamp(0, 1) * 255).round().to(torch.uint8).cpu()


def png_bytes(image: torch.Tensor) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(image.permute(1, 2, 0).numpy()).save(buffer, format="PNG")
    return buffer.getvalue()


def load_png(path: Path) -> torch.Tensor:
    return transforms.functional.pil_to_tensor(Image.open(path).convert("RGB"))


class SettingsChanged(ValueError):
    """DIR already holds images made with other settings."""


def source_version(source: str) -> str:
    """Size and modification time of the weights: a checkpoint rewritten at the same path (a new
    training run) is another source, whose images must not be reused."""
    path = Path(source)
    if is_sharded_checkpoint(path):  # torch writes its .metadata last, once every shard is there
        path = path / METADATA
    elif path.is_dir():  # the denoiser's weights: a UNet's, or an SD3 folder's transformer's
        weights = sorted(path.glob("unet/*.safetensors")) + sorted(path.glob("transformer/*.safetensors"))
        path = (weights or [path / "model_index.json"])[0]
    stat = path.stat()
    return f"{stat.st_size} bytes, mtime {stat.st_mtime_ns}"


def check_settings(folder: Path, settings: dict) -> None:
    """Images in `folder` are reused only if they were made with the same settings."""
    path = folder / "settings.json"
    if path.is_file():
        before = json.loads(path.read_text())
        if before != settings:
            changed = sorted(k for k in settings.keys() | before.keys() if before.get(k) != settings.get(k))
            raise SettingsChanged(
                f"{folder} holds images made with other settings ({', '.join(changed)} differ): "
                "give another --out or delete that folder"
            )
    elif dist.get_global_rank() == 0:
        atomic_write_bytes(path, (json.dumps(settings, indent=1) + "\n").encode())


def batch_features(args, model, inception, clip, dataset, rows, guidance, folder, resolution) -> dict:
    """Generate (or reuse) the images of `rows`; their Inception features and CLIP scores."""
    paths = [folder / f"{row:07d}.png" for row in rows]
    captions = [dataset[row][args.caption_key] for row in rows]
    if all(path.is_file() for path in paths):
        images, made = torch.stack([load_png(path) for path in paths]), 0
    else:
        generated = model.generate(
            captions,
            guidance_scale=guidance,
            num_inference_steps=args.steps,
            height=resolution,
            width=resolution,
            sampler=args.sampler,
            seeds=[args.seed + row for row in rows],
            guidance_rescale=args.guidance_rescale,
        )
        images, made = to_uint8(generated), len(rows)
        for path, image in zip(paths, images, strict=True):
            atomic_write_bytes(path, png_bytes(image))
    device = next(model.parameters()).device
    return {
        "inception": inception(images.to(device)).double().cpu(),
        "clip": clip.scores(images, captions).cpu(),
        "generated": made,
    }


def gather(results: dict[int, dict]) -> list[dict]:
    """Every rank's per-batch results, in batch order (on every rank)."""
    merged = {}
    for part in dist.all_gather_object(results):
        merged.update(part)
    return [merged[i] for i in sorted(merged)]


def cat(results: list[dict], key: str) -> torch.Tensor:
    return torch.cat([result[key] for result in results])


def real_features(args, inception, dataset, batches, resolution, device) -> torch.Tensor:
    """Inception features of the chosen rows' own images, cached in DIR/real-features.pt."""
    key = {"data": args.data, "rows": batches, "resolution": resolution, "extractors": args.extractors}
    cache = args.out / "real-features.pt"
    if cache.is_file():
        saved = torch.load(cache, weights_only=False)
        if saved["key"] == key:
            return saved["features"]
    mine = {}
    for number in range(dist.get_global_rank(), len(batches), dist.get_world_size()):
        images = torch.stack([real_image(dataset[r], args.image_key, resolution) for r in batches[number]])
        mine[number] = {"features": inception(images.to(device)).double().cpu()}
    features = cat(gather(mine), "features")
    if dist.get_global_rank() == 0:
        with atomic_path(cache) as tmp:
            torch.save({"key": key, "features": features}, tmp)
    return features


def evaluate(args) -> list[dict] | None:
    """Run the evaluation; the metric rows on rank 0 (None on the other ranks)."""
    device = get_device(None)
    if dist.get_world_size() > 1:
        dist.initialize_dist(device)
    rank = dist.get_global_rank()
    dataset = open_dataset(args)  # a remote set's index: seconds, where the weights below take minutes
    if problem := too_few(min(args.n, dataset.num_samples)):
        raise UsageError(f"--data {args.data} has {dataset.num_samples} rows: {problem}; give a larger set")
    inception = extractors.inception(args.extractors, args.inception_weights)
    clip = extractors.clip(args.extractors, args.clip_model, args.clip_arch)
    model = load_model(args.source, args.ema, preset=args.preset, prediction_type=args.prediction_type)
    args.sampler = sampler_for(model, args.sampler)  # the family's default; one it has not: an error
    check_sampling_args(
        model, {"--resolution": args.resolution}, ("--guidance-rescale", args.guidance_rescale)
    )
    torch_device = compat_torch_device(device)
    model.to(torch_device), inception.to(torch_device), clip.model.to(torch_device)
    # The native size in pixels: the model's own (a transformer's `native_size()`; Flux's transformer has
    # no sample_size, its VAE's is the size), else the UNet's latent sample_size x the VAE's factor.
    native = model.native_size()[0] if hasattr(model, "native_size") else None
    resolution = args.resolution or native or model.denoiser.config.sample_size * model.vae_scale_factor
    rows = choose_rows(dataset.num_samples, args.n, args.seed)  # len() is per rank
    batches = [rows[i : i + args.batch_size] for i in range(0, len(rows), args.batch_size)]
    mine = range(rank, len(batches), dist.get_world_size())
    log.info("%d captions of %s, %d batches, %d on this rank", len(rows), args.data, len(batches), len(mine))
    real = real_features(args, inception, dataset, batches, resolution, torch_device)

    results, made, grids = [], 0, []
    progress = tqdm(total=len(mine) * len(args.guidance), desc="images", unit="batch", disable=rank != 0)
    for guidance in args.guidance:
        folder = args.out / "images" / f"guidance-{guidance:g}"
        settings = {
            "source": str(Path(args.source).resolve()), "source_version": source_version(args.source),
            "ema": args.ema, "steps": args.steps,
            "sampler": args.sampler, "resolution": resolution, "seed": args.seed, "guidance": guidance,
            "guidance_rescale": model.default_guidance_rescale if args.guidance_rescale is None
            else args.guidance_rescale,
        }  # fmt: skip
        check_settings(folder, settings)
        per_batch = {}
        with torch.no_grad():
            for number in mine:
                per_batch[number] = batch_features(
                    args, model, inception, clip, dataset, batches[number], guidance, folder, resolution
                )
                progress.update()
        everything = gather(per_batch)
        made += sum(result["generated"] for result in everything)
        if rank == 0:
            results.append(
                scores(real, cat(everything, "inception"), cat(everything, "clip"), guidance, args.seed)
            )
            grids += [load_png(folder / f"{row:07d}.png") for row in rows[:SAMPLE_COLUMNS]]
    progress.close()
    dist.barrier()
    if rank != 0:
        return None
    total = len(rows) * len(args.guidance)
    log.info("images: %d generated, %d reused from an earlier run", made, total - made)
    header = (
        f"{args.source} on {len(rows)} captions of {args.data}: {args.sampler} {args.steps} steps, "
        f"{resolution} px, seed {args.seed}, {args.extractors} extractors"
    )
    paths = write_report(args.out, results, header, args.targets)
    save_image(
        torch.stack(grids).float() / 255, args.out / "samples.png", nrow=min(SAMPLE_COLUMNS, len(rows))
    )
    print(paths["md"].read_text(), end="")
    print(f"metrics: {paths['json'].resolve()}\nsamples: {(args.out / 'samples.png').resolve()}")
    return results


def main(argv: list[str] | None = None) -> list[dict] | None:
    # open_clip and streaming log setup chatter at INFO to the root logger; ours stays at INFO.
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    for name in ("evaluation", "models"):
        logging.getLogger(name).setLevel(logging.INFO)
    args = parse_args(argv)
    with one_line_errors(
        PROG, SettingsChanged, SamplerError, UsageError
    ):  # MissingWeights: FileNotFoundError
        check_inputs(args)
        return evaluate(args)


if __name__ == "__main__":
    main()
