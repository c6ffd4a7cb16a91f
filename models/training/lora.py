"""LoRA adapters on the denoiser (a UNet or a transformer) with peft, the way diffusers' LoRA scripts
add them (train_text_to_image_lora.py, train_dreambooth_lora_sd3.py, train_dreambooth_lora_flux.py;
each family's default targets are its `lora_targets` in models/registry.py).

`add_lora(denoiser, rank=..., alpha=..., target_modules=..., dropout=...)` freezes the denoiser, adds a
peft adapter (only its weights require grad, so the optimizer and the EMA hold only them), and makes
the model's checkpoints hold only the trainable tensors: the frozen base comes back from the
pretrained folder, which a LoRA run must load every network from. `save_lora` writes diffusers' LoRA
file with the family pipeline's own `save_lora_weights` (what its `load_lora_weights(dir)` reads:
StableDiffusion(XL)Pipeline's for a UNet, StableDiffusion3Pipeline's or FluxPipeline's for a
transformer); `merge_lora` folds the adapter into the denoiser's weights for a full pipeline export.
"""

from pathlib import Path

import torch

from models.checkpoints.checkpoint_file import LORA_FILE


def base_components(preset: str) -> list[str]:
    """The networks a LoRA run of `preset` must load from its base folder: every one the family always
    has (the denoiser, the VAE, its text encoders; SD3's optional T5 only when loaded), since a LoRA
    checkpoint stores none of their weights."""
    from models.engine.family import OPTIONAL
    from models.registry import of

    family = of(preset)
    return [
        name
        for name, cls in family.components.items()
        if isinstance(cls, type) and issubclass(cls, torch.nn.Module) and name not in OPTIONAL
    ]


def check_lora_options(lora: dict, pretrained: str | None, pretrained_components, preset: str) -> dict:
    """`model.lora` with defaults filled in (the family's targets: models/registry.py `lora_targets`);
    errors name the key."""
    from models.registry import of

    known = {"rank", "alpha", "target_modules", "dropout", "init_from"}
    if unknown := set(lora) - known:
        raise ValueError(f"model.lora: unknown keys {sorted(unknown)}; choose from {sorted(known)}")
    rank = lora.get("rank", 4)
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise ValueError(f"model.lora.rank must be a positive integer, got {rank!r}")
    needed = base_components(preset)
    loaded = of(preset).partners_of(pretrained_components or ())
    missing = [c for c in needed if c not in loaded]
    if pretrained is None or missing:
        raise ValueError(
            "model.lora trains an adapter on a pretrained model: set model.pretrained and load "
            f"{needed} from it (missing: {missing or 'model.pretrained'})"
        )
    options = {
        "rank": rank,
        "alpha": float(lora.get("alpha") or rank),
        "target_modules": list(lora.get("target_modules") or of(preset).lora_targets),
        "dropout": float(lora.get("dropout", 0.0)),
    }
    if lora.get("init_from") is not None:  # a LoRA file to start from (models/training/lora_layouts.py)
        source = Path(str(lora["init_from"])).expanduser()
        if not (source.is_file() or (source / LORA_FILE).is_file()):
            raise ValueError(
                f"model.lora.init_from={lora['init_from']}: no LoRA file there (give a .safetensors file, "
                f"or a folder holding {LORA_FILE})"
            )
        options["init_from"] = str(source)
    return options


def add_lora(denoiser, rank: int, alpha: float, target_modules: list[str], dropout: float) -> None:
    """Freeze `denoiser` and add a trainable adapter to it."""
    from peft import LoraConfig

    denoiser.requires_grad_(False)
    denoiser.add_adapter(
        LoraConfig(
            r=rank,
            lora_alpha=alpha,
            init_lora_weights="gaussian",  # B = 0: the adapted model starts as the base model
            target_modules=list(target_modules),
            lora_dropout=dropout,
        )
    )


def drop_frozen_weights(module, state_dict, prefix, local_metadata) -> None:
    """A state-dict post hook: checkpoints keep only what trains (the adapter) and the buffers."""
    frozen = {prefix + name for name, p in module.named_parameters() if not p.requires_grad}
    for key in frozen & state_dict.keys():
        del state_dict[key]


def lora_state_dict(denoiser) -> dict[str, torch.Tensor]:
    """The adapter's weights as diffusers' LoRA scripts hand them to `save_lora_weights`: a UNet's
    under diffusers' LoRA names (convert_state_dict_to_diffusers), a transformer's under peft's."""
    from peft.utils import get_peft_model_state_dict

    from compat.diffusers import convert_state_dict_to_diffusers

    weights = get_peft_model_state_dict(denoiser)
    return convert_state_dict_to_diffusers(weights) if hasattr(denoiser, "down_blocks") else weights


def save_lora(denoiser, out_dir: str | Path, pipeline_class=None, name: str = "unet") -> Path:
    """diffusers' LoRA file (pytorch_lora_weights.safetensors, with rank/alpha metadata), written by
    `pipeline_class.save_lora_weights` (StableDiffusionPipeline by default) under the denoiser's
    component `name` ("unet" or "transformer"), so that the same class's load_lora_weights reads it.
    Written under a temporary name and put in place once that class's lora_state_dict reads the
    adapter back from it (models/training/lora_layouts.py check_lora_file; LayoutCheckError if not)."""
    from common.atomic import atomic_path
    from models.training.lora_layouts import LayoutCheckError, adapter, check_lora_file

    if pipeline_class is None:
        from diffusers import StableDiffusionPipeline as pipeline_class

    out_dir = Path(out_dir)
    with atomic_path(out_dir / LORA_FILE) as tmp:
        pipeline_class.save_lora_weights(
            out_dir,
            weight_name=tmp.name,
            safe_serialization=True,
            **{
                f"{name}_lora_layers": lora_state_dict(denoiser),
                f"{name}_lora_adapter_metadata": denoiser.peft_config["default"].to_dict(),
            },
        )
        try:
            check_lora_file(tmp, pipeline_class, name, *adapter(denoiser))
        except LayoutCheckError as error:
            raise LayoutCheckError(f"{LORA_FILE} (diffusers layout) was not written: {error}") from None
    return out_dir


def merge_lora(denoiser) -> None:
    """Fold the adapter into the base weights and remove it: a plain denoiser again."""
    denoiser.fuse_lora()
    denoiser.unload_lora()
