"""`model.init: reference`: the MLPerf Training Flux.1 reference's initialisation of a transformer
trained from scratch, applied to diffusers' FluxTransformer2DModel.

The reference (mlcommons/training text_to_image, its torchtitan submodule at 9603aa83:
torchtitan/experiments/flux/model/model.py `FluxModel.init_weights` and model/layers.py, adapted from
DiT's initialisation) sets, with every bias zero:
- image and text input projections (img_in, txt_in): Xavier-uniform;
- time and vector MLPs (time_in, vector_in, both MLPEmbedder): N(0, 0.02);
- each block's attention and MLP linears: Xavier-uniform; its QK RMSNorm weights 1;
- each block's adaLN modulation (img_mod, txt_mod, the single block's modulation) and the final layer
  (its adaLN modulation and its output linear): zero, so each block starts as the identity and the
  model predicts 0.
Its benchmark README asks for special attention to the adaLN and final-layer rule.

diffusers splits some of the reference's fused linears: the reference's `qkv` (dim -> 3 dim) is
to_q/to_k/to_v (add_q_proj/add_k_proj/add_v_proj on the text stream), and the single block's
`linear1` (dim -> 3 dim + mlp) is to_q/to_k/to_v and proj_mlp. Xavier's bound depends on the fused
shape, sqrt(6 / (fan_in + fan_out)), so each split part is drawn from the fused layer's bound (the
split ones' own bound would be sqrt(2) larger for q, k and v). The guidance embedder (FLUX.1-dev's;
the reference trains schnell, which has none) is an MLP like time_in and gets its rule.
A pretrained transformer is never initialised: models/build.py refuses the option with one.
"""

import math

import torch
from torch import nn

EMBEDDER_STD = 0.02  # the reference's init_std of time_in and vector_in


def _xavier(layers: list[nn.Linear]) -> None:
    """Xavier-uniform over `layers` as one fused linear (their outputs stacked), biases zero."""
    fan_in = layers[0].in_features
    fan_out = sum(layer.out_features for layer in layers)
    bound = math.sqrt(6.0 / (fan_in + fan_out))
    for layer in layers:
        nn.init.uniform_(layer.weight, -bound, bound)
        nn.init.zeros_(layer.bias)


def _normal(layers: list[nn.Linear]) -> None:
    for layer in layers:
        nn.init.normal_(layer.weight, std=EMBEDDER_STD)
        nn.init.zeros_(layer.bias)


def _zero(layers: list[nn.Linear]) -> None:
    for layer in layers:
        nn.init.zeros_(layer.weight)
        nn.init.zeros_(layer.bias)


def _qk_norms(attention: nn.Module) -> None:
    for name in ("norm_q", "norm_k", "norm_added_q", "norm_added_k"):
        norm = getattr(attention, name, None)
        if norm is not None and getattr(norm, "weight", None) is not None:
            nn.init.ones_(norm.weight)


@torch.no_grad()
def reference_init(transformer: nn.Module) -> None:
    """Initialise a FluxTransformer2DModel in place by the reference's rule (the module docstring)."""
    _xavier([transformer.x_embedder])
    _xavier([transformer.context_embedder])
    embed = transformer.time_text_embed
    mlps = [
        embed.timestep_embedder,
        *([embed.guidance_embedder] if hasattr(embed, "guidance_embedder") else []),
    ]
    _normal([layer for mlp in mlps for layer in (mlp.linear_1, mlp.linear_2)])
    _normal([embed.text_embedder.linear_1, embed.text_embedder.linear_2])
    for block in transformer.transformer_blocks:
        attn = block.attn
        _xavier([attn.to_q, attn.to_k, attn.to_v])
        _xavier([attn.add_q_proj, attn.add_k_proj, attn.add_v_proj])
        _xavier([attn.to_out[0]])
        _xavier([attn.to_add_out])
        for ff in (block.ff, block.ff_context):
            _xavier([ff.net[0].proj])
            _xavier([ff.net[2]])
        _qk_norms(attn)
        _zero([block.norm1.linear, block.norm1_context.linear])
    for block in transformer.single_transformer_blocks:
        attn = block.attn
        _xavier([attn.to_q, attn.to_k, attn.to_v, block.proj_mlp])  # the reference's linear1
        _xavier([block.proj_out])  # its linear2
        _qk_norms(attn)
        _zero([block.norm.linear])
    _zero([transformer.norm_out.linear, transformer.proj_out])
