"""`model.init: reference` (models/families/flux/reference_init.py): the MLPerf Flux.1 reference's
initialisation on flux-tiny, rule by rule (zeroed modulation and final layer, zero biases, Xavier over the
reference's fused shapes, N(0, 0.02) embedder MLPs), the model it gives (predicting 0 at first), and that
nothing loaded from a folder is initialised again."""

import math

import pytest
import torch

from models import build_model
from models.build import check_model_options

PRESET = "flux-tiny"
FROZEN = ["vae", "text_encoder", "tokenizer", "text_encoder_2", "tokenizer_2"]


@pytest.fixture(scope="module")
def transformer():
    torch.manual_seed(0)
    return build_model(PRESET, init="reference").transformer


def _zeroed(t) -> list[torch.nn.Linear]:
    blocks = [m for b in t.transformer_blocks for m in (b.norm1.linear, b.norm1_context.linear)]
    singles = [b.norm.linear for b in t.single_transformer_blocks]
    return [*blocks, *singles, t.norm_out.linear, t.proj_out]


def _xavier_groups(t) -> list[list[torch.nn.Linear]]:
    """The reference's linears as diffusers splits them: each group is one fused layer there."""
    groups = [[t.x_embedder], [t.context_embedder]]
    for b in t.transformer_blocks:
        a = b.attn
        groups += [[a.to_q, a.to_k, a.to_v], [a.add_q_proj, a.add_k_proj, a.add_v_proj], [a.to_out[0]]]
        groups += [[a.to_add_out], [b.ff.net[0].proj], [b.ff.net[2]], [b.ff_context.net[0].proj]]
        groups += [[b.ff_context.net[2]]]
    for b in t.single_transformer_blocks:
        groups += [[b.attn.to_q, b.attn.to_k, b.attn.to_v, b.proj_mlp], [b.proj_out]]
    return groups


def test_modulation_and_the_final_layer_start_at_zero_and_every_bias_is_zero(transformer):
    for layer in _zeroed(transformer):
        assert not layer.weight.any() and not layer.bias.any()
    linears = [m for m in transformer.modules() if isinstance(m, torch.nn.Linear)]
    assert len(linears) > len(_zeroed(transformer)) and all(not m.bias.any() for m in linears)
    norms = [m.weight for n, m in transformer.named_modules() if n.endswith(("norm_q", "norm_k"))]
    assert norms and all(torch.equal(w, torch.ones_like(w)) for w in norms)


def test_linears_are_xavier_uniform_over_the_references_fused_shapes(transformer):
    """Each group drawn from U(-b, b), b = sqrt(6 / (fan_in + the fused fan_out)): inside b, reaching
    past 0.95 b, with a uniform's std b / sqrt(3). q, k, v on their own would reach sqrt(2) b."""
    groups = _xavier_groups(transformer)
    assert sum(len(g) for g in groups) + len(_zeroed(transformer)) + 4 == sum(
        isinstance(m, torch.nn.Linear) for m in transformer.modules()
    )  # every linear has its rule: these, the zeroed ones and the 4 embedder-MLP layers
    for group in groups:
        bound = math.sqrt(6 / (group[0].in_features + sum(layer.out_features for layer in group)))
        weights = torch.cat([layer.weight.flatten() for layer in group])
        assert weights.abs().max() <= bound and weights.abs().max() > 0.95 * bound
        assert weights.std().item() == pytest.approx(bound / math.sqrt(3), rel=0.1)


def test_time_and_vector_mlps_are_normal_with_std_0_02(transformer):
    embed = transformer.time_text_embed
    for mlp in (embed.timestep_embedder, embed.text_embedder):
        for layer in (mlp.linear_1, mlp.linear_2):
            assert layer.weight.std().item() == pytest.approx(0.02, rel=0.1)
            assert abs(layer.weight.mean().item()) < 0.002


def test_the_initialised_model_predicts_zero_and_its_first_step_moves_only_the_output_layer(transformer):
    """As DiT's: blocks start as the identity and the output layer at zero, so the first gradients
    reach only the final layer (its projection and its modulation's bias through the projection)."""
    torch.manual_seed(0)
    model = build_model(PRESET, init="reference")
    batch = {"image": torch.rand(2, 3, 32, 32) * 2 - 1, **model.conditioner.ids(model, ["a", "b"])}
    prediction, target, _ = model(batch)
    assert not prediction.any() and target.any()
    model.loss((prediction, target, _), batch).backward()
    moved = {n for n, p in model.transformer.named_parameters() if p.grad is not None and p.grad.any()}
    assert moved == {"proj_out.weight", "proj_out.bias"}


@pytest.mark.heavy
def test_nothing_loaded_is_initialised_again_and_a_loaded_transformer_is_refused(tmp_path):
    source = build_model(PRESET)
    for name in FROZEN:
        getattr(source, name).save_pretrained(tmp_path / name)
    model = build_model(PRESET, pretrained=str(tmp_path), pretrained_components=FROZEN, init="reference")
    for name in ("vae", "text_encoder", "text_encoder_2"):
        a, b = getattr(source, name).state_dict(), getattr(model, name).state_dict()
        assert all(torch.equal(a[k], b[k]) for k in a), name
    assert not model.transformer.proj_out.weight.any()
    with pytest.raises(ValueError, match="loads from model.pretrained=.*: leave model.init unset"):
        check_model_options(PRESET, init="reference", pretrained=str(tmp_path))
    with pytest.raises(ValueError, match="preset 'mmdit-tiny' has no such rule"):
        check_model_options("mmdit-tiny", init="reference")
    with pytest.raises(ValueError, match=r"model.init='dit': preset 'flux-tiny' has \['reference'\]"):
        check_model_options(PRESET, init="dit")
