"""models/training/sharding.py: the UNet's FSDP units and activation-checkpointed blocks."""

import functools

import pytest
import torch

from compat.torch import CheckpointImpl, apply_activation_checkpointing, checkpoint_wrapper
from models import build_model
from models.components import build_components
from models.training import sharding


@pytest.mark.parametrize(("preset", "blocks", "layers"), [("tiny", 5, 12), ("sd2-base", 9, 38)])
def test_units_per_granularity(preset, blocks, layers):
    with torch.device("meta"):
        unet = build_components(preset)["unet"]
    assert sharding.units(unet, "unet") == []
    assert len(sharding.units(unet, "blocks")) == blocks  # down blocks, the mid block, up blocks
    assert len(sharding.units(unet, "layers")) == layers  # ResNet and transformer blocks
    sharding.configure(unet, "blocks", "layers")
    assert unet.fsdp_wrap_fn(unet.mid_block) and not unet.fsdp_wrap_fn(unet.conv_in)
    assert unet.activation_checkpointing_fn(unet.mid_block.resnets[0])
    assert not unet.activation_checkpointing_fn(unet.mid_block)


def test_bad_granularity_is_named():
    with pytest.raises(ValueError, match="fsdp_wrap='block'"):
        build_model("tiny", fsdp_wrap="block")
    with pytest.raises(ValueError, match="whole model"):
        build_model("tiny", activation_checkpointing="unet")


def _checkpointed_unet_pair(preset: str, impl):
    """A UNet of `preset` and a copy with its blocks wrapped as Composer wraps them under FSDP with
    activation_checkpointing (apply_activation_checkpointing with the UNet's
    activation_checkpointing_fn and `impl`: NO_REENTRANT when activation_checkpointing_reentrant is
    false, REENTRANT, Composer's default, otherwise), without FSDP."""
    torch.manual_seed(0)
    plain = build_model(preset).unet
    checkpointed = build_model(preset, activation_checkpointing="blocks").unet
    checkpointed.load_state_dict(plain.state_dict())
    wrapper = functools.partial(checkpoint_wrapper, checkpoint_impl=impl)
    apply_activation_checkpointing(
        checkpointed, checkpoint_wrapper_fn=wrapper, check_fn=checkpointed.activation_checkpointing_fn
    )
    assert sum(type(m).__name__ == "CheckpointWrapper" for m in checkpointed.modules()) == 5
    return plain, checkpointed


def _step(unet) -> None:
    generator = torch.Generator().manual_seed(1)
    config = unet.config
    latents = torch.randn(2, 4, 8, 8, generator=generator)
    context = torch.randn(2, 77, config.cross_attention_dim, generator=generator)
    extra = {}
    if config.addition_embed_type == "text_time":  # SDXL's pooled text and micro-conditioning
        pooled = config.projection_class_embeddings_input_dim - 6 * config.addition_time_embed_dim
        extra["added_cond_kwargs"] = {
            "text_embeds": torch.randn(2, pooled, generator=generator),
            "time_ids": torch.randn(2, 6, generator=generator),
        }
    out = unet(latents, torch.tensor([10, 500]), encoder_hidden_states=context, **extra).sample
    out.square().mean().backward()


@pytest.mark.parametrize("preset", ["tiny", "sdxl-tiny"])
@pytest.mark.heavy
def test_checkpointed_blocks_give_the_same_gradients(preset):
    """Non-reentrant checkpointing (what the recipes configure) recomputes each block and gives the
    unsharded UNet's gradients."""
    plain, checkpointed = _checkpointed_unet_pair(preset, CheckpointImpl.NO_REENTRANT)
    for unet in (plain, checkpointed):
        _step(unet)
    for (name, p), (_, q) in zip(plain.named_parameters(), checkpointed.named_parameters(), strict=True):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-5, atol=1e-7, msg=name)


@pytest.mark.heavy
def test_reentrant_checkpointing_breaks_the_unet_backward():
    """Why recipes/checks.py refuses FSDP activation checkpointing unless it is non-reentrant: the
    reentrant wrapper returns a down block's skip connections (inside a nested tuple) detached, and
    SDXL's UNet backward then fails."""
    _, checkpointed = _checkpointed_unet_pair("sdxl-tiny", CheckpointImpl.REENTRANT)
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        _step(checkpointed)


@pytest.mark.slow
def test_per_block_fsdp_trains_like_the_unsharded_unet(tmp_path):
    """Two processes shard the tiny UNet per block with torch FSDP (gloo, CPU) and the policy Composer
    builds from our hooks, checkpoint every layer, and get the unsharded UNet's gradients
    (tests/fsdp_wrap_worker.py). Composer's own FSDP wrapper needs CUDA; `make gpu-check` runs it."""
    from tests.resume_check import composer_run

    result = composer_run(2, ["tests/fsdp_wrap_worker.py", str(tmp_path)], tmp_path)
    logs = "".join(p.read_text() for p in sorted(tmp_path.glob("r*.*")))
    assert result.returncode == 0, result.stderr[-3000:] + logs[-3000:]
    assert sorted(p.name for p in tmp_path.glob("ok-rank*")) == ["ok-rank0", "ok-rank1"]
