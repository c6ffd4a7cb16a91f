"""Run by test_sharding.py under `composer -n 2`: the tiny UNet sharded per block with torch FSDP
(gloo, CPU), using the same policy Composer builds from the UNet's `_fsdp_wrap` / `fsdp_wrap_fn`
(composer/distributed/dist_strategy.py) and its `activation_checkpointing_fn`, trains like the
unsharded UNet. Writes `ok-rankN` when every check held.
"""

import functools
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import ShardingStrategy
from torch.distributed.fsdp.wrap import CustomPolicy

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from compat.torch import CheckpointImpl, apply_activation_checkpointing, checkpoint_wrapper  # noqa: E402
from models import build_model  # noqa: E402


def composer_policy(unet):
    """Composer's lambda_fn: a module's own `_fsdp_wrap` first, else the child's fsdp_wrap_fn."""
    return CustomPolicy(lambda m: bool(m._fsdp_wrap) if hasattr(m, "_fsdp_wrap") else unet.fsdp_wrap_fn(m))


def step(unet, inputs) -> torch.Tensor:
    latents, timesteps, context = inputs
    loss = unet(latents, timesteps, encoder_hidden_states=context).sample.square().mean()
    loss.backward()
    return loss.detach()


def main(out: Path) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    plain = build_model("tiny", fsdp_wrap="blocks", activation_checkpointing="layers").unet
    sharded_unet = build_model("tiny", fsdp_wrap="blocks", activation_checkpointing="layers").unet
    sharded_unet.load_state_dict(plain.state_dict())
    sharded = FSDP(
        sharded_unet,
        sharding_strategy=ShardingStrategy.SHARD_GRAD_OP,  # as sd2-base.yaml
        use_orig_params=True,
        device_id=torch.device("cpu"),
        auto_wrap_policy=composer_policy(sharded_unet),
    )
    wrapper = functools.partial(checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT)
    apply_activation_checkpointing(
        sharded,
        checkpoint_wrapper_fn=wrapper,
        check_fn=lambda m: not isinstance(m, FSDP) and sharded_unet.activation_checkpointing_fn(m),
    )
    fsdp_units = [m for m in sharded.modules() if isinstance(m, FSDP)]
    assert len(fsdp_units) == 1 + 5, len(fsdp_units)  # the root + tiny's 2 down, 1 mid, 2 up blocks
    checkpointed = [m for m in sharded.modules() if type(m).__name__ == "CheckpointWrapper"]
    assert len(checkpointed) == 12, len(checkpointed)  # every ResNet and transformer block

    # The same global batch: each rank takes its half, the plain model all of it; FSDP averages grads.
    generator = torch.Generator().manual_seed(1)
    latents = torch.randn(4, 4, 8, 8, generator=generator)
    timesteps = torch.randint(0, 1000, (4,), generator=generator)
    context = torch.randn(4, 77, plain.config.cross_attention_dim, generator=generator)
    mine = slice(2 * rank, 2 * rank + 2)
    step(plain, (latents, timesteps, context))
    step(sharded, (latents[mine], timesteps[mine], context[mine]))
    with FSDP.summon_full_params(sharded, with_grads=True):
        for (name, p), (_, q) in zip(plain.named_parameters(), sharded.named_parameters(), strict=True):
            torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-6, msg=name)
    (out / f"ok-rank{rank}").touch()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
