"""The kohya / ComfyUI layout of a FLUX.2 transformer's LoRA (the family's `lora_kohya`).

Black Forest Labs' module names with `_` after `lora_unet_` (`lora_unet_double_blocks_0_img_attn_qkv`,
`.lora_down.weight`, `.lora_up.weight`, `.alpha`; the scale alpha / lora_down's rows), as diffusers 0.42.1
reads them back (Flux2KleinPipeline.lora_state_dict -> _convert_kohya_flux2_lora_to_diffusers,
loaders/lora_conversion_utils.py:2596-2778, whose table is DOUBLE, SINGLE and OUTER below).

BFL fuses each double block's q, k and v of either stream into one `qkv`; their LoRAs are stacked as
FLUX.1's (models/families/flux/lora_layout.py): lora_down the parts' downs one after another (3 r rows),
lora_up block-diagonal, alpha 3 times ours, which the converter splits back exactly (its "sparse" case,
2640-2672). A single block's fused projections are diffusers' own modules (`attn.to_qkv_mlp_proj` is
`linear1`, `attn.to_out` is `linear2`): nothing to split, at any width.
"""

import re

import torch

from models.engine.family import LayoutUnavailable

# Diffusers' module in a double block (transformer_blocks.{i}.) -> BFL's (double_blocks_{i}_).
DOUBLE = {
    "attn.to_out.0": "img_attn_proj",
    "attn.to_add_out": "txt_attn_proj",
    "ff.linear_in": "img_mlp_0",
    "ff.linear_out": "img_mlp_2",
    "ff_context.linear_in": "txt_mlp_0",
    "ff_context.linear_out": "txt_mlp_2",
    **dict.fromkeys(("attn.to_q", "attn.to_k", "attn.to_v"), "img_attn_qkv"),
    **dict.fromkeys(("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj"), "txt_attn_qkv"),
}
# ... in a single block (single_transformer_blocks.{i}. -> single_blocks_{i}_).
SINGLE = {"attn.to_qkv_mlp_proj": "linear1", "attn.to_out": "linear2"}
# Outside the blocks (lora_conversion_utils.py:2764-2772; the modulations it does not read).
OUTER = {
    "x_embedder": "img_in",
    "context_embedder": "txt_in",
    "time_guidance_embed.timestep_embedder.linear_1": "time_in_in_layer",
    "time_guidance_embed.timestep_embedder.linear_2": "time_in_out_layer",
    "proj_out": "final_layer_linear",
}
# A fused module's parts, in BFL's order.
FUSED = {
    "img_attn_qkv": ("attn.to_q", "attn.to_k", "attn.to_v"),
    "txt_attn_qkv": ("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj"),
}
BLOCK = re.compile(r"(transformer_blocks|single_transformer_blocks)\.(\d+)\.(.+)")


def _place(module: str) -> tuple[str, str, str]:
    """(BFL's module, the block's diffusers prefix, the part's name in it) of a diffusers module."""
    block = BLOCK.fullmatch(module)
    if block is None:
        if module not in OUTER:
            raise LayoutUnavailable(f"the kohya layout diffusers reads has no place for {module}")
        return OUTER[module], "", module
    kind, index, part = block.groups()
    table, prefix = (DOUBLE, "double_blocks") if kind == "transformer_blocks" else (SINGLE, "single_blocks")
    if part not in table:
        raise LayoutUnavailable(f"the kohya layout diffusers reads has no place for {module}")
    return f"{prefix}_{index}_{table[part]}", f"{kind}.{index}.", part


def flux2_kohya(state: dict[str, torch.Tensor], alpha: float, denoiser) -> dict[str, torch.Tensor]:
    """The adapter's tensors (peft's names, `state`) in kohya's FLUX.2 layout."""
    groups: dict[str, tuple[str, dict]] = {}  # BFL module -> (block prefix, part -> (down, up))
    for name in sorted(state):
        if ".lora_A." in name:
            module = name.split(".lora_A.")[0]
            bfl, block, part = _place(module)
            pair = state[name], state[name.replace(".lora_A.", ".lora_B.")]
            groups.setdefault(bfl, (block, {}))[1][part] = pair
    tensors = {}
    for bfl, (block, parts) in groups.items():
        names = FUSED.get(bfl.split("_", 3)[-1]) if block else None
        if names:  # zeros for a part without an adapter: the converter reads it as a zero LoRA
            rank, width = next(iter(parts.values()))[0].shape
            pairs = [
                parts.get(
                    p,
                    (
                        torch.zeros(rank, width),
                        torch.zeros(denoiser.get_submodule(block + p).out_features, rank),
                    ),
                )
                for p in names
            ]
            down, up = torch.cat([d for d, _ in pairs]), torch.block_diag(*[u for _, u in pairs])
            module_alpha = alpha * len(names)
        else:
            (down, up), module_alpha = parts.popitem()[1], alpha
        tensors[f"lora_unet_{bfl}.lora_down.weight"] = down.contiguous()
        tensors[f"lora_unet_{bfl}.lora_up.weight"] = up.contiguous()
        tensors[f"lora_unet_{bfl}.alpha"] = torch.tensor(float(module_alpha))
    return tensors
