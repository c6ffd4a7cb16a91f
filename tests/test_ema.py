import math
import threading
import time

import pytest
import torch

from compat.torch import TorchDispatchMode
from extensions import ema_offload
from extensions.ema import EMA


def _model():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 2))
    model[2].requires_grad_(False)  # a frozen part, like the VAE and text encoder
    return model


def _train_and_reference(ema: EMA, model, batches: int, start: int, interval: int, smoothing: float):
    """Drive `ema` through `batches` steps of fake training; return the closed-form average."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    ema._bind(model)
    ema.step(0, update=False)  # what FIT_START does
    reference = [p.detach().clone() for p in trainable] if start == 0 else None
    for batch in range(1, batches + 1):
        with torch.no_grad():
            for p in trainable:
                p.add_(torch.randn_like(p))
        ema.step(batch)
        if batch == start:
            reference = [p.detach().clone() for p in trainable]
        elif reference is not None and (batch - start) % interval == 0:
            s = smoothing**interval
            reference = [s * r + (1 - s) * p.detach() for r, p in zip(reference, trainable)]
    return reference


@pytest.mark.parametrize("start, interval", [(3, 1), (3, 2), (5, 4)])
def test_matches_closed_form(start, interval):
    model = _model()
    ema = EMA(smoothing=0.9, update_interval=interval, ema_start=f"{start}ba")
    reference = _train_and_reference(ema, model, batches=13, start=start, interval=interval, smoothing=0.9)
    averaged = list(ema.averaged_state().values())
    assert len(averaged) == len(reference) == 4  # two trainable Linear + BatchNorm weight and bias
    for got, want in zip(averaged, reference):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_half_life_means_the_same_batches_at_any_interval():
    assert EMA(half_life="10ba").smoothing == pytest.approx(0.5 ** (1 / 10))
    assert EMA(half_life=10, update_interval=5).smoothing == pytest.approx(0.5 ** (1 / 10))
    model = _model()
    ema = EMA(half_life=10, update_interval=5, ema_start=0)
    ema._bind(model)
    ema.step(0)
    start = [e.clone() for e in ema.averaged_state().values()]
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    for batch in range(1, 11):
        ema.step(batch)
    # After one half-life the average moved halfway from the start to the (constant) new weights.
    for s, e in zip(start, ema.averaged_state().values()):
        torch.testing.assert_close(e, s + 0.5, rtol=1e-5, atol=1e-5)
    assert math.isclose(ema.smoothing**10, 0.5)


def test_nothing_allocated_before_start_and_only_trainable_tracked():
    model = _model()
    ema = EMA(smoothing=0.5, ema_start="4ba")
    ema._bind(model)
    for batch in range(0, 4):
        ema.step(batch)
        assert ema._ema is None and ema.averaged_state() == {}
    ema.step(4)
    names = list(ema.averaged_state())
    assert names == ["0.weight", "0.bias", "1.weight", "1.bias"]
    trainable_bytes = sum(p.numel() * 4 for p in model.parameters() if p.requires_grad)
    assert sum(e.numel() * e.element_size() for e in ema.averaged_state().values()) == trainable_bytes


def test_swap_exchanges_weights_without_copies_and_back():
    model = _model()
    ema = EMA(smoothing=0.5)
    ema._bind(model)
    ema.step(0)
    with torch.no_grad():
        model[0].weight.add_(1.0)
    ema.step(1)
    raw = model[0].weight.detach().clone()
    averaged = ema.averaged_state()["0.weight"].clone()
    storage = ema.averaged_state()["0.weight"].data_ptr()
    with ema.averaged_weights():
        torch.testing.assert_close(model[0].weight.detach(), averaged)
        assert model[0].weight.data_ptr() == storage  # exchanged, not copied
    torch.testing.assert_close(model[0].weight.detach(), raw)


def test_bf16_storage():
    model = _model()
    ema = EMA(smoothing=0.9, storage="bf16")
    reference = _train_and_reference(ema, model, batches=6, start=0, interval=1, smoothing=0.9)
    for got, want in zip(ema.averaged_state().values(), reference):
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2)
    raw = model[0].weight.detach().clone()
    averaged = ema.averaged_state()["0.weight"].float()
    with ema.averaged_weights():  # copied in (dtypes differ)
        assert torch.equal(model[0].weight.detach(), averaged)
    assert torch.equal(model[0].weight.detach(), raw)  # raw weights come back at full precision


class _SlowCopy:
    """A stand-in for CUDA's copy engine on a CPU: each copy lands in a background thread a few
    milliseconds later, like a non-blocking device-to-host copy the CPU may read too early.
    `wait=False` hands back an event that does not wait: what an offload that reads the copies
    without synchronising sees."""

    def __init__(self, wait: bool = True):
        self.wait = wait
        self.threads: list[threading.Thread] = []
        self.copies = 0

    def begin(self) -> None:
        pass

    def start(self, src, dst):
        def land():
            time.sleep(0.003)
            dst.copy_(src)

        thread = threading.Thread(target=land)
        thread.start()
        self.threads.append(thread)
        self.copies += 1
        return type("Event", (), {"synchronize": staticmethod(thread.join if self.wait else lambda: None)})


def _offloaded_and_plain(monkeypatch, copy, storage="fp32", batches=4):
    monkeypatch.setattr(ema_offload, "OFFLOAD_CHUNK", 7)  # parameters of 32, 8 and 16 values span many chunks
    model = _model()
    plain, offloaded = EMA(smoothing=0.7, storage=storage), EMA(smoothing=0.7, storage=storage, offload=True)
    offloaded._copy = copy
    for ema in (plain, offloaded):
        ema._bind(model)
        ema.step(0, update=False)
    for batch in range(1, batches + 1):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p))
        for ema in (plain, offloaded):
            ema.step(batch)
    for thread in copy.threads:
        thread.join()
    return plain.averaged_state(), offloaded.averaged_state()


@pytest.mark.parametrize("storage", ["fp32", "bf16"])
def test_offload_waits_for_each_chunk_copy_before_reading_it(monkeypatch, storage):
    copy = _SlowCopy()
    plain, offloaded = _offloaded_and_plain(monkeypatch, copy, storage)
    assert copy.copies == 4 * (5 + 2 + 2 + 2)  # 4 updates x chunks of 7: weight 32, bias 8, BN 8 and 8
    for name in plain:
        assert torch.equal(plain[name], offloaded[name]), name


def test_the_slow_copy_catches_an_offload_that_does_not_wait(monkeypatch):
    plain, offloaded = _offloaded_and_plain(monkeypatch, _SlowCopy(wait=False))
    assert not all(torch.equal(plain[name], offloaded[name]) for name in plain)


def test_state_dict_round_trip():
    model = _model()
    ema = EMA(smoothing=0.8, ema_start=2)
    _train_and_reference(ema, model, batches=5, start=2, interval=1, smoothing=0.8)
    state = ema.state_dict()
    fresh = EMA(smoothing=0.8, ema_start=2)
    fresh.load_state_dict(state)
    fresh._bind(model)
    fresh._restore(fresh._loaded)
    assert fresh.start_batch == 2
    for a, b in zip(ema.averaged_state().values(), fresh.averaged_state().values()):
        assert torch.equal(a, b) and a.data_ptr() != b.data_ptr()


def _extra_bytes(before: list[torch.Tensor], work) -> tuple[int, int]:
    """(peak, still held) bytes of the tensors `work()` made, counted per op by bench/ema.py's
    counter (tensors in `before` do not count)."""
    from bench.ema import _LiveBytes

    live = _LiveBytes(before)
    with live.mode:
        work()
    return live.peak, live.current


@pytest.mark.parametrize("masters", [False, True])
def test_the_average_is_one_fp32_copy_made_at_start_and_updated_in_place(masters):
    """The memory bench/ema.py checks (<= 1.05 x 4 B x trainable parameters): exactly one fp32 copy,
    nothing before ema_start, nothing more at the update, with fp32 weights and with bf16 weights
    whose fp32 masters the optimizer keeps (the EMA averages those, and holds no second copy)."""
    from extensions.master_weights import MasterWeightAdamW, master_of

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(4, 16, 3), torch.nn.Linear(16, 8), torch.nn.Linear(8, 2))
    model[0].to(memory_format=torch.channels_last)
    model[2].requires_grad_(False)
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = MasterWeightAdamW(trainable, lr=1e-2) if masters else torch.optim.SGD(trainable, lr=1e-2)
    if masters:
        model[:2].to(torch.bfloat16)

    def train():  # outside the count: the optimizer's own memory is not the EMA's
        for p in trainable:
            p.grad = torch.randn_like(p)
        optimizer.step()

    train()
    ema = EMA(smoothing=0.9, ema_start=2)
    ema._bind(model)
    ema.optimizers = [optimizer]
    held = list(model.parameters()) + [t for s in optimizer.state.values() for t in s.values()]
    assert _extra_bytes(held, lambda: ema.step(1)) == (0, 0)  # before ema_start
    peak, kept = _extra_bytes(held, lambda: ema.step(2))
    assert peak == kept == 4 * sum(p.numel() for p in trainable)
    sources = [master_of(optimizer, p) if masters else p for p in trainable]
    assert all(s is not None and s.dtype == torch.float32 for s in sources)
    averaged = list(ema.averaged_state().values())
    assert [e.stride() for e in averaged] == [p.stride() for p in trainable]  # channels-last too
    assert all(torch.equal(e, s) for e, s in zip(averaged, sources))
    train()
    want = [torch.lerp(e, s, 1 - 0.9) for e, s in zip(averaged, sources)]
    assert _extra_bytes(held + averaged, lambda: ema.step(3)) == (0, 0)  # in place
    assert all(torch.equal(e, w) for e, w in zip(averaged, want))


def test_averages_take_their_parameters_layout_without_making_tensors():
    """The strides empty_like would give (the average's layout), worked out without one."""
    from extensions.ema import _dense_strides

    dense = [
        torch.empty(2, 3, 4, 5),
        torch.empty(2, 3, 4, 5).to(memory_format=torch.channels_last),
        torch.empty(8, 3, 1, 1).to(memory_format=torch.channels_last),
        torch.empty(4, 6).t(),
        torch.empty(5),
        torch.empty(()),
    ]
    for t in dense:
        assert _dense_strides(t) == t.stride() == torch.empty_like(t).stride()
    assert _dense_strides(torch.empty(8, 6)[::2]) == (6, 1)  # not dense: row-major
    with _OpCount() as count:
        _dense_strides(dense[1])
    assert count.ops == 0


def test_the_bench_counts_real_bytes_only():
    """A meta tensor holds no memory (the EMA's once made bench/ema.py report 1.093x); a temporary
    counts in the peak and not once freed."""
    before = torch.ones(256)
    peak, kept = _extra_bytes([before], lambda: (torch.empty(1 << 20, device="meta"), before * 2))
    assert (peak, kept) == (1024, 0)


class _OpCount(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        return func(*args, **(kwargs or {}))


def test_bad_options_are_named():
    with pytest.raises(ValueError, match="exactly one of half_life or smoothing"):
        EMA()
    with pytest.raises(ValueError, match="must be in batches"):
        EMA(half_life="2ep")
    with pytest.raises(ValueError, match="storage"):
        EMA(smoothing=0.9, storage="int8")


@pytest.mark.subprocess
@pytest.mark.parametrize("processes", [2, 1])
def test_under_fsdp_checkpoints_hold_the_whole_average_and_load_into_shards(tmp_path, processes):
    """Processes shard a small model with torch FSDP (gloo, CPU); the EMA's checkpoint is the
    whole average under plain names, loads back into each rank's shards, and evaluation swaps it in
    (checked against the same model unsharded, in tests/ema_fsdp_worker.py). On one process FSDP
    does not shard (NO_SHARD), as on a one-GPU run, where checkpointing the EMA once failed."""
    from tests.resume_check import composer_run

    result = composer_run(processes, ["tests/ema_fsdp_worker.py", str(tmp_path)], tmp_path)
    logs = "".join(p.read_text() for p in sorted(tmp_path.glob("r*.*")))
    assert result.returncode == 0, result.stderr[-3000:] + logs[-3000:]
    assert sorted(p.name for p in tmp_path.glob("ok-rank*")) == [f"ok-rank{r}" for r in range(processes)]
