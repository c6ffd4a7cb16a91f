"""The CPU-offloaded update of an EMA (extensions/ema.py, `EMA(offload=True)` on a GPU run).

The average lives in host memory; each update brings the weights (or their fp32 masters) to the
host in chunks through two pinned staging buffers per dtype read, the copies queued on a side
stream. Each chunk's copy is waited for (a CUDA event) before the CPU reads it, and the next
chunk's copy overlaps this chunk's CPU update.

`ChunkedOffload` takes its copier as an argument: `CudaCopy` on a GPU; a test may hand it a fake
with the same `begin()` / `start(src, dst) -> event` interface whose copies land late, like a
non-blocking device-to-host copy that the CPU may read too early (tests/test_ema.py `_SlowCopy`).
"""

import torch

# Elements per offload chunk: 16M (64 MB in fp32) is large enough that a PCIe copy runs near its
# bandwidth and small enough that two pinned buffers cost little host memory.
OFFLOAD_CHUNK = 1 << 24


class CudaCopy:
    """Asynchronous device-to-host copies on a side stream, each with an event to wait on.

    `begin()` orders the side stream after the optimizer step (the current stream); `start(src,
    dst)` queues `dst.copy_(src)` and returns the copy's event, whose `synchronize()` the CPU must
    call before reading `dst`: a non-blocking copy into pinned memory returns before the bytes have
    arrived.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.stream = torch.cuda.Stream(device)

    def begin(self) -> None:
        self.stream.wait_stream(torch.cuda.current_stream(self.device))

    def start(self, src: torch.Tensor, dst: torch.Tensor):
        with torch.cuda.stream(self.stream):
            dst.copy_(src, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.stream)
        return done


class ChunkedOffload:
    """Updates CPU averages from device tensors through `copy` (a `CudaCopy` or a test's fake).

    `staging` holds two pinned buffers of up to OFFLOAD_CHUNK elements per dtype read (the
    weights', the masters'), made at the first update that reads the dtype.
    """

    def __init__(self, copy):
        self.copy = copy
        self.staging: dict[torch.dtype, list[torch.Tensor]] = {}

    def _staging_for(self, dtype: torch.dtype, averages: list[torch.Tensor]) -> list[torch.Tensor]:
        if dtype not in self.staging:
            chunk = min(OFFLOAD_CHUNK, max(e.numel() for e in averages))
            pin = torch.cuda.is_available()
            self.staging[dtype] = [torch.empty(chunk, dtype=dtype, pin_memory=pin) for _ in range(2)]
        return self.staging[dtype]

    def update(self, averages: list[torch.Tensor], sources: list[torch.Tensor], weight: float) -> None:
        """The CPU averages from GPU weights (or their fp32 masters: twice the bytes over PCIe of
        bf16 weights, but the average of what the optimizer holds, with no cast on the CPU): chunk
        k+1 is copied while the CPU updates chunk k.

        A staging buffer is refilled only after the CPU has finished reading it (updates run in
        order; at most two chunks are in flight, and a buffer's turns are two apart), and every copy
        is waited for before this returns, so the next optimizer step cannot change a weight while it
        is being read.
        """
        flats = []  # (average, source), each flat in the average's memory order
        for e, p in zip(averages, sources):
            src = p.detach()
            order = sorted(range(e.dim()), key=e.stride, reverse=True)
            if order != list(range(e.dim())):  # e.g. channels-last: dims in memory order
                e, src = e.permute(order), src.permute(order)
            if not src.is_contiguous():  # laid out unlike the average: rearranged (before begin())
                src = src.contiguous()
            flats.append((e.view(-1), src.view(-1)))
        self.copy.begin()
        pending = []  # (average chunk, staging view, copy done)
        turn = 0
        for flat_e, flat_p in flats:
            staging = self._staging_for(flat_p.dtype, averages)
            for start in range(0, flat_p.numel(), len(staging[0])):
                src = flat_p[start : start + len(staging[0])]
                staged = staging[turn % 2][: src.numel()]
                turn += 1
                pending.append((flat_e[start : start + src.numel()], staged, self.copy.start(src, staged)))
                if len(pending) == 2:
                    self._lerp_when_copied(*pending.pop(0), weight)
        for item in pending:
            self._lerp_when_copied(*item, weight)

    @staticmethod
    def _lerp_when_copied(e: torch.Tensor, staged: torch.Tensor, done, weight: float) -> None:
        done.synchronize()
        e.lerp_(staged if staged.dtype == e.dtype else staged.to(e.dtype), weight)
