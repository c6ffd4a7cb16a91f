"""models/sharding.py: the UNet's FSDP units and activation-checkpointed blocks."""

import pytest
import torch

from compat.torch import apply_activation_checkpointing
from models import build_model, sharding
from models.presets import build_components


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


def test_checkpointed_blocks_give_the_same_gradients():
    """What Composer applies under FSDP with activation_checkpointing (apply_activation_checkpointing
    with the UNet's activation_checkpointing_fn), without FSDP: the gradients do not change."""
    torch.manual_seed(0)
    plain = build_model("tiny").unet
    checkpointed = build_model("tiny", activation_checkpointing="blocks").unet
    checkpointed.load_state_dict(plain.state_dict())
    apply_activation_checkpointing(checkpointed, check_fn=checkpointed.activation_checkpointing_fn)
    assert sum(type(m).__name__ == "CheckpointWrapper" for m in checkpointed.modules()) == 5
    generator = torch.Generator().manual_seed(1)
    latents, context = (
        torch.randn(2, 4, 8, 8, generator=generator),
        torch.randn(2, 77, 32, generator=generator),
    )
    for unet in (plain, checkpointed):
        unet(
            latents, torch.tensor([10, 500]), encoder_hidden_states=context
        ).sample.square().mean().backward()
    for (name, p), (_, q) in zip(plain.named_parameters(), checkpointed.named_parameters(), strict=True):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-5, atol=1e-7, msg=name)


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
