"""Run by test_ema.py under `composer -n 2`: the EMA on an FSDP-sharded model (torch FSDP, gloo, CPU).

Each rank also keeps the same model unsharded with its own EMA and applies the same updates, so
the sharded average can be checked against the plain one: gathered whole for checkpoints, scattered
back into shards on load, and swapped in for evaluation. Writes `ok-rankN` when every check held.
"""

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import ShardingStrategy

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from extensions.ema import EMA  # noqa: E402


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Linear(7, 6), torch.nn.Linear(6, 3))
    net[2].requires_grad_(False)  # a frozen part, like the VAE and text encoder
    return net


def each_linear(module: torch.nn.Module, recurse: bool, nonwrapped_numel: int) -> bool:
    return recurse or isinstance(module, torch.nn.Linear)  # FSDP units below the root, too


def main(out: Path) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    plain = model()
    sharded = FSDP(
        model(),
        sharding_strategy=ShardingStrategy.SHARD_GRAD_OP,  # as sd2-base.yaml
        use_orig_params=True,
        device_id=torch.device("cpu"),
        auto_wrap_policy=each_linear,
    )
    ema_plain, ema_sharded = EMA(smoothing=0.8), EMA(smoothing=0.8)
    ema_plain._bind(plain)
    ema_sharded._bind(sharded)
    assert sorted(ema_sharded._names) == sorted(ema_plain._names), (ema_sharded._names, ema_plain._names)
    for batch in range(4):
        generator = torch.Generator().manual_seed(batch)
        updates = {n: torch.randn(p.shape, generator=generator) for n, p in plain.named_parameters()}
        with torch.no_grad(), FSDP.summon_full_params(sharded, writeback=True):
            for (n, p), (_, q) in zip(plain.named_parameters(), sharded.named_parameters()):
                p.add_(updates[n])
                q.add_(updates[n])
        ema_plain.step(batch)
        ema_sharded.step(batch)

    # A checkpoint holds the whole average under plain names, equal to the unsharded EMA's.
    state = ema_sharded.state_dict()
    expected = ema_plain.state_dict()["ema"]
    assert state["ema"].keys() == expected.keys()
    for name, value in expected.items():
        torch.testing.assert_close(state["ema"][name], value, rtol=0, atol=1e-6, msg=name)
    raw = {n: p.detach().clone() for n, p in sharded.named_parameters()}
    assert all(torch.equal(p, raw[n]) for n, p in sharded.named_parameters())  # raw weights back

    # Loading it into a fresh EMA on the sharded model gives back this rank's shards.
    fresh = EMA(smoothing=0.8)
    fresh._bind(sharded)
    fresh.load_state_dict(state)
    assert all(torch.equal(a, b) for a, b in zip(fresh._ema, ema_sharded._ema))
    assert all(torch.equal(p, raw[n]) for n, p in sharded.named_parameters())

    # Evaluation with the average swapped in computes what the unsharded average computes.
    x = torch.randn(4, 5, generator=torch.Generator().manual_seed(9))
    with torch.no_grad(), ema_sharded.averaged_weights(), ema_plain.averaged_weights():
        torch.testing.assert_close(sharded(x), plain(x), rtol=0, atol=1e-5)
    with torch.no_grad():
        torch.testing.assert_close(sharded(x), plain(x), rtol=0, atol=1e-5)  # raw again, both
    assert all(torch.equal(p, raw[n]) for n, p in sharded.named_parameters())
    (out / f"ok-rank{rank}").write_text("ok")
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
