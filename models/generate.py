"""Sample a grid of images from a Composer checkpoint or an exported diffusers folder.

    python -m models.generate CHECKPOINT_OR_DIR "a red circle" "a blue square" --out grid.png \
        [--n-per-prompt 4] [--seed 0] [--steps 25] [--guidance 5] [--sampler ddim|euler|dpm++] \
        [--negative-prompt "..."] [--guidance-rescale 0.7] [--ema | --raw] [--device cuda]

One row per prompt, `--n-per-prompt` columns. Every row starts from the same seeded noise, so column
j differs between rows only by the prompt, and a prompt's row does not depend on the other prompts.
--ema/--raw, --preset and --prediction-type say how to read a checkpoint; a folder carries its own.
The sampler defaults to the model family's: DDIM for SD and SDXL, flow-matching Euler steps (the only
one) for an mmdit model, whose checkpoints and StableDiffusion3Pipeline folders both load here.

Numbers out of range are one line before the model loads (--steps and --n-per-prompt at least 1,
--guidance finite and >= 0, --guidance-rescale in [0, 1]); --height and --width must be multiples of
the model's VAE factor (times the patch size for an mmdit model), checked once it has loaded and
before any sampling: the line names the nearest valid sizes, where sampling would silently round.
"""

import argparse
import json
import logging
from pathlib import Path

import torch
from torchvision.utils import save_image

import models.registry as families
from models.checkpoints.checkpoint_file import (
    CheckpointError,
    check_checkpoint_file,
    folder_problem,
    one_line_errors,
)
from models.checkpoints.sharded_checkpoint import is_sharded_checkpoint
from models.cli_checks import (
    UsageError,
    check_count,
    check_guidance,
    check_guidance_rescale,
    check_sampling_args,
)
from models.components import load_folder
from models.engine.objectives import SAMPLERS
from models.export import add_weight_args, load_model_from_checkpoint
from models.families.mmdit.model import RectifiedFlowTransformer
from models.families.sd.model import StableDiffusion

log = logging.getLogger(__name__)

GRID_PADDING = 2  # pixels between the images of the grid (torchvision's default)
PROG = "python -m models.generate"  # argparse's default would be "generate.py"


class SamplerError(ValueError):
    """A sampler the model's family has not (the CLIs print it as one line)."""


def sampler_for(model, sampler: str | None) -> str:
    """`sampler`, or the model family's default (its first: DDIM for a UNet, the flow's Euler steps)
    when None; a sampler the family has not is a SamplerError that names the ones it has."""
    family = families.of_model(model)
    if sampler is None:
        return family.samplers[0]
    if sampler not in family.samplers:
        raise SamplerError(
            f"sampler {sampler!r}: an {family.name} model samples with {' or '.join(family.samplers)}"
        )
    return sampler


def load_model_from_pipeline_dir(folder: str | Path) -> StableDiffusion | RectifiedFlowTransformer:
    """The model of a diffusers pipeline folder (models.export's output, or any folder with the same
    components), on the CPU in eval mode: the family whose networks its subfolders hold
    (models.registry.of_components: a StableDiffusionXL with a `text_encoder_2/`, a
    RectifiedFlowTransformer with a `transformer/`, T5 too when it has one)."""
    folder = Path(folder)
    if not (folder / "model_index.json").is_file():
        raise FileNotFoundError(f"{folder} is not a diffusers pipeline folder (no model_index.json)")
    pipeline = json.loads((folder / "model_index.json").read_text()).get("_class_name")
    family = families.of_components((path.name for path in folder.iterdir() if path.is_dir()), pipeline)
    model = family.model_class(**load_folder(folder, family))
    log.info("%s: loaded the %s pipeline's components", folder, family.pipeline.__name__)
    return model.eval()


def check_source(path: str | Path, ema: bool | None = None) -> Path:
    """load_model's checks that read a few bytes at most (the path is there, a checkpoint is whole,
    --ema/--raw only with a checkpoint): CLIs make them before anything slow."""
    path = Path(path)
    if path.is_dir() and not is_sharded_checkpoint(path):
        if ema is not None:
            raise CheckpointError(
                f"--ema/--raw choose weights inside a checkpoint; {path} is an exported folder that "
                "already holds the weights it was exported with"
            )
        if not (path / "model_index.json").is_file():
            raise FileNotFoundError(folder_problem(path))
        return path
    if not path.exists():
        raise FileNotFoundError(f"no checkpoint or pipeline folder at {path}")
    return check_checkpoint_file(path)


def load_model(
    path: str | Path, ema: bool | None = None, **checkpoint_kwargs
) -> StableDiffusion | RectifiedFlowTransformer:
    """A checkpoint file or an exported pipeline folder, whichever `path` is."""
    path = check_source(path, ema)
    if path.is_dir() and not is_sharded_checkpoint(path):
        return load_model_from_pipeline_dir(path)
    return load_model_from_checkpoint(path, ema, **checkpoint_kwargs)


def sample_grid(
    model: StableDiffusion | RectifiedFlowTransformer,
    prompts: list[str],
    n_per_prompt: int = 1,
    *,
    seed: int = 0,
    **generate_kwargs,
) -> torch.Tensor:
    """Images (len(prompts) * n_per_prompt, 3, H, W) in [0, 1], prompt-major (a row per prompt)."""
    if not prompts:
        raise ValueError("give at least one prompt")
    if n_per_prompt < 1:
        raise ValueError(f"n_per_prompt must be >= 1, got {n_per_prompt}")
    rows = []
    for prompt in prompts:  # one prompt at a time: the same noise per row and bounded memory
        rows.append(model.generate([prompt] * n_per_prompt, seed=seed, **generate_kwargs).cpu())
    return torch.cat(rows)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog=PROG, description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument(
        "source", help="a Composer checkpoint (a file or a sharded checkpoint's folder) or a pipeline folder"
    )
    parser.add_argument("prompts", nargs="+", help="one grid row per prompt")
    parser.add_argument("--out", required=True, help="PNG file to write")
    parser.add_argument("--n-per-prompt", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=25)
    parser.add_argument("--guidance", type=float, default=5.0, help="classifier-free guidance scale")
    parser.add_argument(
        "--sampler",
        choices=sorted(SAMPLERS),
        default=None,
        help="default: the model's (ddim for SD and SDXL, euler for an mmdit model, its only one)",
    )
    parser.add_argument("--negative-prompt", default=None)
    parser.add_argument(
        "--guidance-rescale",
        type=float,
        default=None,
        help="diffusers' guidance rescale (default: 0.7 for a zero-terminal-SNR model, else 0)",
    )
    parser.add_argument("--height", type=int, default=None, help="pixels (default: the model's size)")
    parser.add_argument("--width", type=int, default=None)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    add_weight_args(parser)
    return parser.parse_args(argv)


def check_args(args: argparse.Namespace) -> None:
    """The numbers' ranges, before the model loads (UsageError)."""
    for flag, value in (("--n-per-prompt", args.n_per_prompt), ("--steps", args.steps)):
        check_count(flag, value)
    for flag, value in (("--height", args.height), ("--width", args.width)):
        check_count(flag, value)  # 0 would silently mean the model's size
    check_guidance("--guidance", args.guidance)
    check_guidance_rescale("--guidance-rescale", args.guidance_rescale)
    out = Path(args.out)
    if out.suffix.lower() != ".png" or out.is_dir():  # found by save_image only after the sampling
        raise UsageError(f"--out {out}: give a .png file to write the grid to")


# The token-id columns of a conditioner (models/engine/conditioners.py `id_lengths`) and their tokenizers.
TOKENIZERS = {"input_ids": "tokenizer", "input_ids_2": "tokenizer_2", "input_ids_3": "tokenizer_3"}


def warn_truncated(model, prompts: list[str]) -> list[str]:
    """Log (and return) a line for each prompt longer than a text encoder reads: the tokens past its
    length are cut, as training cut the captions, and a user should know the end was not seen."""
    lines = []
    for column, length in model.conditioner.id_lengths(model).items():
        tokenizer = getattr(model, TOKENIZERS[column], None)
        if tokenizer is None:
            continue
        for prompt in prompts:
            count = len(tokenizer(prompt, verbose=False)["input_ids"])  # verbose: transformers' own warning
            if count > length:
                words = " ".join(prompt.split()[:6])
                lines.append(
                    f"the prompt '{words} ...' is {count} tokens for {type(tokenizer).__name__}, whose text "
                    f"encoder reads {length}: the last {count - length} are cut"
                )
                log.warning(lines[-1])
    return lines


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    args = parse_args(argv)
    with one_line_errors(PROG, SamplerError, UsageError):
        check_args(args)
        model = load_model(args.source, args.ema, preset=args.preset, prediction_type=args.prediction_type)
        sampler = sampler_for(model, args.sampler)
        sizes = {"--height": args.height, "--width": args.width}
        check_sampling_args(model, sizes, ("--guidance-rescale", args.guidance_rescale))
    warn_truncated(model, args.prompts)
    model.to(args.device)
    images = sample_grid(
        model,
        args.prompts,
        args.n_per_prompt,
        seed=args.seed,
        negative_prompt=args.negative_prompt,
        guidance_scale=args.guidance,
        guidance_rescale=args.guidance_rescale,
        num_inference_steps=args.steps,
        height=args.height,
        width=args.width,
        sampler=sampler,
    )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    save_image(images, out, nrow=args.n_per_prompt, padding=GRID_PADDING)
    print(f"grid: {out.resolve()}  ({len(args.prompts)} rows x {args.n_per_prompt} columns)")


if __name__ == "__main__":
    main()
