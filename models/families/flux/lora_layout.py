"""The kohya / ComfyUI layout of a FLUX.1 transformer's LoRA (the family's `lora_kohya`).

kohya sd-scripts' (networks/lora_flux.py): Black Forest Labs' module names, dots as underscores, after
`lora_unet_` (`lora_unet_double_blocks_0_img_attn_qkv.lora_down.weight`, `.lora_up.weight`, `.alpha`;
the scale is alpha / lora_down's rows). ComfyUI reads it (every weight of its Flux as "lora_unet_" + its
name), and diffusers reads it back (FluxPipeline.lora_state_dict: _convert_kohya_flux_lora_to_diffusers,
sd-scripts' convert_flux_lora.py).

BFL fuses what diffusers keeps apart: each double block's q, k and v of either stream into one `qkv`,
each single block's q, k, v and MLP input into `linear1`. Their parts' LoRAs are stacked as sd-scripts'
split_qkv saves them: lora_down the parts' downs one after another (n x r rows), lora_up block-diagonal
(part j's up in its rows and in columns j r to (j + 1) r), a part without an adapter all zeros. Diffusers'
converter finds that structure and hands each part back exactly (the untrained part as a zero LoRA); a
fused module's alpha is n times ours, so that every reader's alpha / rows is our alpha / r. Diffusers
splits a single block's linear1 at FLUX.1's widths only (3072 x 3, 12288; sd-scripts' split_qkv too)
and reads FLUX.1's 19 double and 38 single blocks: a model of other sizes has no layout here.
"""

import re

import torch

from models.engine.family import LayoutUnavailable

# Diffusers' module in a double block (transformer_blocks.{i}.) -> BFL's (double_blocks_{i}_).
DOUBLE = {
    "attn.to_out.0": "img_attn_proj",
    "ff.net.0.proj": "img_mlp_0",
    "ff.net.2": "img_mlp_2",
    "norm1.linear": "img_mod_lin",
    "attn.to_add_out": "txt_attn_proj",
    "ff_context.net.0.proj": "txt_mlp_0",
    "ff_context.net.2": "txt_mlp_2",
    "norm1_context.linear": "txt_mod_lin",
    **dict.fromkeys(("attn.to_q", "attn.to_k", "attn.to_v"), "img_attn_qkv"),
    **dict.fromkeys(("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj"), "txt_attn_qkv"),
}
# ... in a single block (single_transformer_blocks.{i}. -> single_blocks_{i}_).
SINGLE = {
    "proj_out": "linear2",
    "norm.linear": "modulation_lin",
    **dict.fromkeys(("attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp"), "linear1"),
}
# Outside the blocks (diffusers' converter reads these; not norm_out, whose alpha it drops).
OUTER = {
    "x_embedder": "img_in",
    "context_embedder": "txt_in",
    "time_text_embed.timestep_embedder.linear_1": "time_in_in_layer",
    "time_text_embed.timestep_embedder.linear_2": "time_in_out_layer",
    "time_text_embed.text_embedder.linear_1": "vector_in_in_layer",
    "time_text_embed.text_embedder.linear_2": "vector_in_out_layer",
    "time_text_embed.guidance_embedder.linear_1": "guidance_in_in_layer",
    "time_text_embed.guidance_embedder.linear_2": "guidance_in_out_layer",
}
# A fused module's parts, in BFL's order.
FUSED = {
    "img_attn_qkv": ("attn.to_q", "attn.to_k", "attn.to_v"),
    "txt_attn_qkv": ("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj"),
    "linear1": ("attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp"),
}
# What diffusers' converter reads (FLUX.1's blocks; linear1 split at FLUX.1-dev/schnell's widths).
READ_BLOCKS = {"transformer_blocks": 19, "single_transformer_blocks": 38}
READ_LINEAR1 = (3072, 3072, 3072, 12288)
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
    if int(index) >= READ_BLOCKS[kind]:
        raise LayoutUnavailable(
            f"diffusers reads FLUX.1's {READ_BLOCKS[kind]} {kind} in the kohya layout, not {module}"
        )
    return f"{prefix}_{index}_{table[part]}", f"{kind}.{index}.", part


def _fused(parts: dict, names: tuple[str, ...], block: str, denoiser) -> tuple[torch.Tensor, torch.Tensor]:
    """One fused module's (lora_down, lora_up) from its parts' (down, up), zeros for a part without."""
    rank, width = next(iter(parts.values()))[0].shape
    downs, ups = [], []
    for part in names:
        out = denoiser.get_submodule(block + part).out_features
        down, up = parts.get(part, (torch.zeros(rank, width), torch.zeros(out, rank)))
        downs.append(down)
        ups.append(up)
    widths = tuple(up.shape[0] for up in ups)
    if len(names) == len(READ_LINEAR1) and widths != READ_LINEAR1:
        raise LayoutUnavailable(
            f"diffusers splits a single block's fused linear1 at FLUX.1's widths {READ_LINEAR1} only, "
            f"this model's are {widths}"
        )
    return torch.cat(downs), torch.block_diag(*ups)


def flux_kohya(state: dict[str, torch.Tensor], alpha: float, denoiser) -> dict[str, torch.Tensor]:
    """The adapter's tensors (peft's names, `state`) in kohya's FLUX.1 layout."""
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
        if names:
            (down, up), module_alpha = _fused(parts, names, block, denoiser), alpha * len(names)
        else:
            (down, up), module_alpha = parts.popitem()[1], alpha
        tensors[f"lora_unet_{bfl}.lora_down.weight"] = down.contiguous()
        tensors[f"lora_unet_{bfl}.lora_up.weight"] = up.contiguous()
        tensors[f"lora_unet_{bfl}.alpha"] = torch.tensor(float(module_alpha))
    return tensors
