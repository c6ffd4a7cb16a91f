"""Run by tests/test_fsdp2_hsdp.py under `composer -n 4` (tests/launch.py): torch FSDP2 (`fully_shard`)
over gloo, on a 1-D mesh (4 shards) and a 2-D one (HSDP: 2 copies x 2 shards).

Both meshes must give the unsharded model's gradients of the same global batch. On torch 2.7 gloo's
reduce-scatter summed where FSDP2 asked it to average (the 1-D mesh's gradients came out 4x) and HSDP
failed ("Cannot use ReduceOp.AVG with Gloo"), so a shim in compat/torch.py made both SUM and divide
once; torch 2.14 does both right, and the shim is gone. Writes `ok-rankN` (JSON: the best of 5 step
times per mesh) when every check held.
"""

import json
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

WIDTH, BATCH = 64, 8  # BATCH samples per rank


def model() -> torch.nn.Module:
    torch.manual_seed(0)  # the same weights on every rank and in every copy
    # 70 rows do not split evenly over 4 shards: FSDP2 pads, and the padding must not leak.
    block = torch.nn.Sequential(torch.nn.Linear(WIDTH, 70), torch.nn.GELU(), torch.nn.Linear(70, WIDTH))
    second = torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH))
    return torch.nn.Sequential(block, second, torch.nn.Linear(WIDTH, 3))


def sharded(mesh) -> torch.nn.Module:
    net = model()
    for block in list(net)[:2]:  # a unit per block and the root, as the recipes shard
        fully_shard(block, mesh=mesh)
    return fully_shard(net, mesh=mesh)


def step(net, inputs) -> float:
    net.zero_grad()
    start = time.perf_counter()
    net(inputs).square().mean().backward()
    return time.perf_counter() - start


def full_grads(net) -> dict[str, torch.Tensor]:
    return {n: p.grad.full_tensor() for n, p in net.named_parameters()}


def main(out: Path) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    inputs = torch.randn(BATCH * world, WIDTH, generator=torch.Generator().manual_seed(1))
    mine = inputs[BATCH * rank : BATCH * (rank + 1)]
    plain = model()
    plain(inputs).square().mean().backward()  # the mean over the global batch: the gradient to get
    want = {n: p.grad for n, p in plain.named_parameters()}
    meshes = {
        "1-D": init_device_mesh("cpu", (world,)),
        "HSDP": init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp_replicate", "dp_shard")),
    }

    got, times = {}, {}
    for name, mesh in meshes.items():
        net = sharded(mesh)
        step(net, mine)  # the first step sets FSDP2 up
        got[name] = full_grads(net)
        times[name] = min(step(net, mine) for _ in range(5))
    for name, grads in got.items():
        for n, g in want.items():
            torch.testing.assert_close(grads[n], g, rtol=1e-5, atol=1e-7, msg=f"{name}: {n}")
    for n in want:  # the two meshes add the same numbers in another order: a few last bits apart
        torch.testing.assert_close(got["HSDP"][n], got["1-D"][n], rtol=1e-6, atol=1e-8, msg=n)
    report = {"step_s": times}
    (out / f"ok-rank{rank}").write_text(json.dumps(report))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
