"""LoRA adapters on the UNet with peft, the way diffusers' train_text_to_image_lora.py adds them.

`add_lora(model, rank=..., alpha=..., target_modules=..., dropout=...)` freezes the UNet, adds a
peft adapter (only its weights require grad, so the optimizer and the EMA hold only them), and makes
the model's checkpoints hold only the trainable tensors: the frozen base comes back from the
pretrained folder, which a LoRA run must load every network from. `save_lora` writes diffusers' LoRA
file (what `StableDiffusionPipeline.load_lora_weights(dir)` reads, or for an SDXL UNet
`StableDiffusionXLPipeline.load_lora_weights(dir)`); `merge_lora` folds the adapter into the UNet's
weights for a full pipeline export.
"""

from pathlib import Path

import torch

# Attention projections, as diffusers' LoRA training example targets.
DEFAULT_TARGETS = ("to_k", "to_q", "to_v", "to_out.0")
# Every network comes from the base folder: a LoRA checkpoint stores none of their weights. (An
# SDXL model loads text_encoder_2 wherever it loads text_encoder: models.build._partners.) UNet
# presets only: models.build.build_model refuses model.lora for an mmdit preset.
BASE_COMPONENTS = ("unet", "vae", "text_encoder")


def check_lora_options(lora: dict, pretrained: str | None, pretrained_components) -> dict:
    """`model.lora` with defaults filled in; errors name the key."""
    known = {"rank", "alpha", "target_modules", "dropout"}
    if unknown := set(lora) - known:
        raise ValueError(f"model.lora: unknown keys {sorted(unknown)}; choose from {sorted(known)}")
    rank = lora.get("rank", 4)
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise ValueError(f"model.lora.rank must be a positive integer, got {rank!r}")
    missing = [c for c in BASE_COMPONENTS if c not in pretrained_components]
    if pretrained is None or missing:
        raise ValueError(
            "model.lora trains an adapter on a pretrained model: set model.pretrained and load "
            f"{list(BASE_COMPONENTS)} from it (missing: {missing or 'model.pretrained'})"
        )
    return {
        "rank": rank,
        "alpha": float(lora.get("alpha") or rank),
        "target_modules": list(lora.get("target_modules") or DEFAULT_TARGETS),
        "dropout": float(lora.get("dropout", 0.0)),
    }


def add_lora(unet, rank: int, alpha: float, target_modules: list[str], dropout: float) -> None:
    """Freeze `unet` and add a trainable adapter to it."""
    from peft import LoraConfig

    unet.requires_grad_(False)
    unet.add_adapter(
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


def lora_state_dict(unet) -> dict[str, torch.Tensor]:
    """The adapter's weights under diffusers' LoRA names."""
    from peft.utils import get_peft_model_state_dict

    from compat.diffusers import convert_state_dict_to_diffusers

    return convert_state_dict_to_diffusers(get_peft_model_state_dict(unet))


def save_lora(unet, out_dir: str | Path, pipeline_class=None) -> Path:
    """diffusers' LoRA file (pytorch_lora_weights.safetensors, with rank/alpha metadata), written by
    `pipeline_class.save_lora_weights` (StableDiffusionPipeline by default; StableDiffusionXLPipeline
    for an SDXL UNet), so that the same class's load_lora_weights reads it."""
    if pipeline_class is None:
        from diffusers import StableDiffusionPipeline as pipeline_class

    out_dir = Path(out_dir)
    pipeline_class.save_lora_weights(
        out_dir,
        unet_lora_layers=lora_state_dict(unet),
        unet_lora_adapter_metadata=unet.peft_config["default"].to_dict(),
        safe_serialization=True,
    )
    return out_dir


def merge_lora(unet) -> None:
    """Fold the adapter into the base weights and remove it: a plain UNet again."""
    unet.fuse_lora()
    unet.unload_lora()
