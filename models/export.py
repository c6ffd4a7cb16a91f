"""Composer checkpoint -> StableDiffusion(XL) or rectified-flow model -> diffusers pipeline folder:
a `StableDiffusionPipeline` (`StableDiffusionXLPipeline` for an SDXL model, `StableDiffusion3Pipeline`
for an mmdit one, `FluxPipeline` for a Flux one: models/families/flux/folder.py).

    python -m models.export CHECKPOINT OUT_DIR [--ema | --raw] [--preset tiny]

CHECKPOINT is a checkpoint file (`ep0-ba200-rank0.pt`, `latest-rank0.pt`) or a sharded run's
checkpoint folder (`ep0-ba200/`, read on one process whatever the number of ranks that wrote it:
models/checkpoints/sharded_checkpoint.py); a LoRA run's checkpoint exports with `--lora` or `--merge-lora`.

`--lora` writes the adapter alone, in the two layouts LoRA files travel in, side by side in OUT_DIR:
pytorch_lora_weights.safetensors (diffusers / peft: `Pipeline.load_lora_weights(OUT_DIR)`) and
OUT_DIR's name + `_kohya.safetensors` (kohya / ComfyUI: ComfyUI's models/loras, AUTOMATIC1111, kohya's
tools; diffusers' load_lora_weights(FILE) reads it too). Both, always, with no flag to choose: the
files are megabytes, the user need not know at export time which tool will load the adapter, and
diffusers' load_lora_weights(OUT_DIR) picks its own file by name. Each is read back with diffusers and
compared with the adapter before it is put in place (models/training/lora_layouts.py); a failed check
ends the export with one line and writes nothing. A model that has no kohya layout diffusers reads
back (SD3; a Flux of other widths than FLUX.1's) gets diffusers' file alone, and the export says why.

A checkpoint carries its model record (models/checkpoints/record.py: model family, component configs, noise
schedule, prediction type, zero-terminal SNR, latent scale, preset), and that exact model is rebuilt;
a `--preset` or `--prediction-type` that contradicts it is an error. Checkpoints written before the
record existed are read as before, with a warning: the architecture is inferred by matching their
tensor shapes against every preset of their family in models/presets.py (mmdit when they hold a
`transformer`, else SDXL when they hold a text_encoder_2; or named with `--preset`) and the
prediction type comes from `--prediction-type` (default epsilon). The denoiser (the UNet, or an
mmdit model's transformer) is the EMA average when the checkpoint has one (`--ema`, the default then)
or the raw training weights (`--raw`). The exported folder loads with
`StableDiffusionPipeline.from_pretrained(OUT_DIR)` (SDXL: `StableDiffusionXLPipeline`, which zeroes
the unconditional condition as training's caption dropout did: force_zeros_for_empty_prompt) and
samples like `generate` with the DDIM sampler.

An mmdit model's folder is a StableDiffusion3Pipeline's: the transformer, the VAE (its config holds
the model's latent scale and shift, scaling_factor and shift_factor, which the pipeline decodes with),
both CLIP encoders and tokenizers, T5 (text_encoder_3, tokenizer_3) only when the model reads it, and
the training run's FlowMatchEulerDiscreteScheduler with the shift the model trained with at its native
size (`RectifiedFlowTransformer.shift_for`: with `timestep_shift: auto` the native size's
sqrt(pixels / 256^2), which the pipeline then keeps at every size). Without T5, diffusers loads it only as
`StableDiffusion3Pipeline.from_pretrained(OUT_DIR, text_encoder_3=None, tokenizer_3=None)` (its own
way of leaving T5 off; model_index.json has them null). It samples like `generate` when called with
`max_sequence_length=t5_tokens`: the length of the T5 part of the context the model trained with (77
for sd3-medium, 8 for mmdit-tiny), zeros when there is no T5, which the transformer still attends to
(its context embedder turns them into its bias), so the pipeline's default of 256 gives other
images. OUT_DIR/README.md says both and the shift (its front matter's `max_sequence_length` is what
models.generate reads back), and the export logs them.

OUT_DIR must be new or empty: a folder holding anything else (another pipeline, whose stale
text_encoder_2/ would make the result load as SDXL) is refused before the checkpoint is read. The
folder is written beside OUT_DIR under a temporary name and renamed into place when complete, so a
failed or killed export leaves no half-written OUT_DIR.
"""

import argparse
import functools
import inspect
import logging
from pathlib import Path

import torch
from accelerate import init_empty_weights

import models.registry as families
from models.build import bundled_tokenizers
from models.checkpoints.checkpoint_file import (
    LORA_FILE,
    CheckpointError,
    ema_state,
    master_state,
    one_line_errors,
    raw_state,
    read_checkpoint,
)
from models.checkpoints.record import autoencoder_preset, read_record, rebuild_model
from models.components import build_components
from models.engine.family import OBJECTIVE_OPTIONS
from models.families.mmdit.model import RectifiedFlowTransformer
from models.families.sd.model import StableDiffusion
from models.out_dir import WriteError, check_out_dir, written_into_place
from models.registry import PRESETS
from models.training.lora import merge_lora, save_lora
from models.training.lora_layouts import LayoutCheckError, save_kohya

log = logging.getLogger(__name__)

# The networks a preset has of these (an mmdit preset's T5 only when the preset builds it, bundled_t5).
COMPONENTS = ("unet", "transformer", "vae", "text_encoder", "text_encoder_2", "text_encoder_3")
PROG = "python -m models.export"  # argparse's default would be "export.py"


@functools.cache
def _preset_shapes(preset: str) -> dict[str, tuple[int, ...]]:
    # Built on the meta device: shapes of sd2-base's 1.3B parameters with no memory and no init.
    with torch.device("meta"):
        components = build_components(preset, skip=("noise_scheduler",))
    shapes = {
        f"{name}.{key}": tuple(tensor.shape)
        for name in COMPONENTS
        if name in components
        for key, tensor in components[name].state_dict().items()
    }
    # The model's buffers: the VAE's latent scale (and an mmdit model's latent shift).
    return {**shapes, **{name: () for name in ("latent_scale", "latent_shift") if name in components}}


def _difference(expected: dict, weights: dict) -> str | None:
    """The first way `weights` does not fit a preset's shapes, or None when they match."""
    missing, unexpected = expected.keys() - weights.keys(), weights.keys() - expected.keys()
    if missing or unexpected:
        return f"{len(missing)} missing and {len(unexpected)} unexpected tensors, e.g. " + ", ".join(
            sorted(missing)[:1] + sorted(unexpected)[:1]
        )
    for key, shape in expected.items():
        if tuple(weights[key].shape) != shape:
            return f"{key} is {tuple(weights[key].shape)}, the preset has {shape}"
    return None


def weights_family(weights: dict[str, torch.Tensor]) -> str:
    """The family of a state dict (models.registry.family): the one whose networks its tensors' prefixes
    name, the most of them (models.registry.of_components)."""
    return families.of_components({key.split(".")[0] for key in weights}).name


def infer_preset(weights: dict[str, torch.Tensor]) -> str:
    """The preset whose architecture has exactly these tensor names and shapes. Only the presets of
    the weights' family are built (on the meta device): the others' names cannot match anyway."""
    differences = {}
    for preset in families.presets_of(families.of_components({key.split(".")[0] for key in weights})):
        differences[preset] = _difference(_preset_shapes(preset), weights)
        if differences[preset] is None:
            return preset
    details = "; ".join(f"{preset}: {why}" for preset, why in differences.items())
    raise CheckpointError(f"the checkpoint's weights match no preset in models/presets.py ({details})")


def load_model_from_checkpoint(
    path: str | Path,
    ema: bool | None = None,
    *,
    preset: str | None = None,
    prediction_type: str | None = None,
    stored_base: bool = True,
) -> StableDiffusion | RectifiedFlowTransformer:
    """The StableDiffusion (StableDiffusionXL, RectifiedFlowTransformer) model of a Composer
    checkpoint, on the CPU in eval mode.

    ema: True for the EMA-averaged denoiser (an error if the checkpoint has none), False for the raw
        training weights, None for the average when there is one.
    preset, prediction_type: checked against the checkpoint's model record; for a checkpoint
        without one, the architecture (inferred from the tensor shapes when None) and what the UNet
        predicts (epsilon when None; an mmdit model predicts the flow, and takes no prediction type).
    stored_base: a LoRA checkpoint's base stored as its run stored it (model.base_weights: bf16, fp8,
        nf4), the model that trained; False: as its folder holds it (what --merge-lora merges into).
    """
    state = read_checkpoint(path)
    vae_preset = autoencoder_preset(state)
    if vae_preset is not None:
        raise CheckpointError(
            f"{path} is a checkpoint of an autoencoder run ({vae_preset}): a VAE alone, with no denoiser "
            "to sample with or export as a pipeline; its run's save_pretrained callback writes the VAE "
            "(yamls/tiny-vae.yaml: runs/tiny-vae/export), which a diffusion recipe loads with "
            "model.pretrained and pretrained_components: [vae]"
        )
    # In fp32 whatever the run trained in: a model.param_dtype=bfloat16 run's weights are its
    # optimizer's fp32 masters (the bf16 ones are those rounded), so it loads, samples and exports
    # at full precision as every other model does.
    low = (torch.bfloat16, torch.float16)
    weights = {k: v.float() if v.dtype in low else v for k, v in raw_state(state).items()}
    weights.update({k: v for k, v in master_state(state).items() if k in weights})
    averaged = ema_state(state)
    if ema and averaged is None:
        raise CheckpointError(
            f"--ema: {path} has no EMA weights (the run had no EMA algorithm, or saved before its "
            "ema_start); export the raw weights with --raw"
        )
    use_ema = averaged is not None if ema is None else ema
    if use_ema:
        unknown = averaged.keys() - weights.keys()
        if unknown:
            raise CheckpointError(f"EMA state names tensors the model lacks, e.g. {sorted(unknown)[:3]}")
        # Copies in the model's dtype: the average may be stored in bf16, and its tensors are views
        # into one flat buffer, which safetensors refuses to save as separate tensors.
        weights.update({k: v.to(weights[k].dtype, copy=True) for k, v in averaged.items()})
    log.info("%s: %s trained weights", path, "EMA-averaged" if use_ema else "raw")

    record = read_record(state)
    # Parameters on the meta device, replaced by the checkpoint's tensors below: no random init of
    # weights about to be overwritten. Buffers (CLIP's position ids, not in the state dict) stay real.
    if record is not None:
        for flag, key, given in (
            ("--preset", "preset", preset),
            ("--prediction-type", "prediction_type", prediction_type),
        ):
            if given is not None and record.get(key) is not None and given != record[key]:
                raise CheckpointError(
                    f"{flag} {given} contradicts the checkpoint, which records {key}={record[key]!r}"
                )
        if record.get("lora"):
            return _lora_model(path, record, weights, stored_base)
        with init_empty_weights():
            model = rebuild_model(record)
        log.info(
            "%s: model from its record (preset %s, %s)", path, record.get("preset"), record["prediction_type"]
        )
    else:
        log.warning(
            "%s has no model record (written before checkpoints carried one): the architecture is inferred "
            "from its shapes, the prediction type is %s (--prediction-type) and the noise schedule is the "
            "preset's, so a zero-terminal-SNR run exports wrong; retrain or re-save to record it",
            path,
            prediction_type or "epsilon",
        )
        if preset is None:
            preset = infer_preset(weights)
            log.info("%s: inferred preset %r from the tensor shapes", path, preset)
        elif preset not in PRESETS:
            raise ValueError(f"unknown model preset {preset!r}; choose one of {sorted(PRESETS)}")
        elif (why := _difference(_preset_shapes(preset), weights)) is not None:
            raise CheckpointError(f"{path} does not hold preset {preset!r}: {why}")
        family = families.of(preset)
        if "prediction_type" not in family.options:
            if prediction_type is not None:
                raise CheckpointError(
                    f"--prediction-type {prediction_type}: preset {preset!r} predicts the flow "
                    "(rectified flow), it takes no prediction type"
                )
            # Unrecorded: the default options, so it samples with the preset scheduler's shift.
            options = families.preset_options(preset)
        else:
            options = {"prediction_type": prediction_type or "epsilon"}
        with init_empty_weights():
            components = build_components(preset)
        model = family.model_class(**bundled_tokenizers(preset), **options, **components)
        model.preset = preset
    model.load_state_dict(weights, strict=True, assign=True)
    return model.eval()


def _lora_model(path, record: dict, weights: dict, stored_base: bool = True):
    """A LoRA checkpoint holds the adapter only: the base comes from the folder the run loaded."""
    from models.build import HUB_ID, build_model

    source = record["pretrained"]["source"]
    if not Path(source).expanduser().exists() and not HUB_ID.match(source):
        raise FileNotFoundError(
            f"{path} is a LoRA checkpoint: it holds the adapter only, and its base model {source} "
            "(the run's model.pretrained) is not there"
        )
    family = families.of(record["preset"])
    # The objective's options the record keeps (a DDPM's prediction type and zero-terminal SNR; a flow's
    # timestep options): the sampler the export writes comes from them.
    options = {k: record[k] for k in OBJECTIVE_OPTIONS[family.objective] if k in record}
    if stored_base and record.get("base_weights"):
        options["base_weights"] = record["base_weights"]
    model = build_model(
        record["preset"],
        pretrained=source,
        pretrained_components=record["pretrained"]["components"],
        lora=record["lora"],
        **options,
    )
    missing, unexpected = model.load_state_dict(weights, strict=False)
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    if unexpected or trainable & set(missing):
        raise CheckpointError(
            f"{path}: the adapter does not fit its record ({len(unexpected)} unexpected tensors, "
            f"{len(trainable & set(missing))} adapter tensors missing)"
        )
    log.info("%s: LoRA adapter (rank %d) on the base model %s", path, record["lora"]["rank"], source)
    return model.eval()


def export_pipeline(model: StableDiffusion | RectifiedFlowTransformer, out_dir: str | Path) -> Path:
    """Write `model` as a diffusers StableDiffusionPipeline folder (safetensors weights); an SDXL
    model as a StableDiffusionXLPipeline folder, an mmdit model as a StableDiffusion3Pipeline folder
    with a README.md that says its max_sequence_length. `out_dir` must be new or empty (check_out_dir);
    it appears only once complete."""
    out_dir = Path(out_dir)
    with written_into_place(out_dir) as tmp:
        _write_pipeline(model, tmp, out_dir)
    return out_dir


def _write_pipeline(model, folder: Path, out_dir: Path) -> None:
    """The pipeline's files into `folder` (a temporary name for `out_dir`, which the log names)."""
    # The pipeline decodes with vae.config.scaling_factor; the model with its own latent_scale. A VAE
    # that takes none (FLUX.2's: its batch-norm statistics, weights of its own) has latent_scale 1.
    if "scaling_factor" in inspect.signature(type(model.vae)).parameters:
        model.vae.register_to_config(scaling_factor=float(model.latent_scale))
    family = families.of_model(model)
    if family.save_folder is not None:
        family.save_folder(model, folder, shown_as=out_dir)
        return
    pipeline_class = family.pipeline
    pipeline = pipeline_class(**model.pipeline_parts())
    pipeline.save_pretrained(folder, safe_serialization=True)
    log.info("wrote a %s to %s", pipeline_class.__name__, out_dir)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog=PROG, description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument(
        "checkpoint",
        help="a checkpoint file (ep0-ba200-rank0.pt) or a sharded checkpoint's folder (ep0-ba200)",
    )
    parser.add_argument("out_dir", help="folder to write the diffusers pipeline to")
    add_weight_args(parser)
    lora = parser.add_mutually_exclusive_group()
    lora.add_argument(
        "--lora",
        action="store_true",
        help="LoRA run: the adapter alone, in diffusers' layout and kohya / ComfyUI's (each checked)",
    )
    lora.add_argument("--merge-lora", action="store_true", help="LoRA run: a full pipeline, adapter merged")
    return parser.parse_args(argv)


def add_weight_args(parser: argparse.ArgumentParser) -> None:
    """--ema/--raw, --preset and --prediction-type: how to read a checkpoint (shared with generate)."""
    weights = parser.add_mutually_exclusive_group()
    weights.add_argument(
        "--ema",
        dest="ema",
        action="store_true",
        default=None,
        help="EMA-averaged UNet or transformer (default when present)",
    )
    weights.add_argument("--raw", dest="ema", action="store_false", help="raw training weights")
    parser.add_argument(
        "--preset",
        choices=sorted(PRESETS),
        help="architecture (default: the checkpoint's record; without one, inferred from the shapes)",
    )
    parser.add_argument(
        "--prediction-type",
        choices=("epsilon", "v_prediction"),
        default=None,
        help="what the UNet predicts (default: the checkpoint's record; without one, epsilon); not for "
        "an mmdit model, which predicts the flow",
    )


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    args = parse_args(argv)
    with one_line_errors(PROG, FileExistsError, WriteError, LayoutCheckError):
        export(args)


def export(args: argparse.Namespace) -> None:
    check_out_dir(args.out_dir)  # in milliseconds, before a checkpoint of gigabytes is read
    # --merge-lora folds the adapter into the base as its folder holds it, never into a bf16, float8 or
    # NF4 copy (model.base_weights): the merged pipeline is the base plus the adapter, the weights
    # load_lora_weights on the base pipeline gives, without the quantisation's rounding baked in.
    model = load_model_from_checkpoint(
        args.checkpoint,
        args.ema,
        preset=args.preset,
        prediction_type=args.prediction_type,
        stored_base=not args.merge_lora,
    )
    if getattr(model, "lora", None) is None:
        if args.lora or args.merge_lora:
            raise CheckpointError(
                f"{args.checkpoint} is not a LoRA checkpoint; export it without --lora/--merge-lora"
            )
    elif args.lora:
        family = families.of_model(model)
        out_dir = Path(args.out_dir)
        with written_into_place(out_dir) as tmp:
            save_lora(model.denoiser, tmp, family.pipeline, family.denoiser)
            kohya, why_not = save_kohya(model.denoiser, tmp, family, out_dir.resolve().name)
        print(f"LoRA weights: {out_dir.resolve()}")
        print(f"  {LORA_FILE}: diffusers / peft layout ({family.pipeline.__name__}.load_lora_weights(DIR))")
        if kohya is not None:
            print(f"  {kohya.name}: kohya / ComfyUI layout (ComfyUI, AUTOMATIC1111, kohya, diffusers)")
        else:
            print(f"  no kohya / ComfyUI file: {why_not}")
        return
    elif args.merge_lora:
        merge_lora(model.denoiser)
    else:
        raise CheckpointError(
            f"{args.checkpoint} is a LoRA checkpoint: --lora writes the adapter file, --merge-lora a full "
            "pipeline with the adapter merged"
        )
    out_dir = export_pipeline(model, args.out_dir)
    print(f"pipeline: {out_dir.resolve()}")


if __name__ == "__main__":
    main()
