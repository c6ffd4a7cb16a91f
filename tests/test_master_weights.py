"""bf16 model weights with fp32 master weights in the optimizer (model.param_dtype=bfloat16,
extensions/master_weights.py): the masters step exactly as torch's AdamW over fp32 weights, survive a
save and load unrounded, an fp32 EMA averages them (not the rounded weights) in one fused update, and
the tiny recipe trains, resumes bitwise, evaluates and samples with them.
"""

import copy
import io
import math

import pytest
import torch
from composer.core import Callback

from compat.torch import TorchDispatchMode
from extensions import ema_offload
from extensions.callbacks import read_loss_log
from extensions.ema import EMA, find_ema
from extensions.master_weights import MasterWeightAdamW, master_of
from models import build_model
from models.export import load_model_from_checkpoint
from recipes import ConfigError, build_trainer, load_config, parse_config
from tests.conftest import REPO, tiny_run
from tests.test_ema import _SlowCopy
from tests.test_golden import GOLDEN

TINY = REPO / "yamls/tiny-cpu.yaml"
KERNELS = {"fused": dict(fused=True), "foreach": dict(foreach=True), "single": dict(foreach=False)}
ADAMW = dict(lr=1e-2, betas=(0.9, 0.99), weight_decay=0.1)


def _module() -> torch.nn.Module:
    """bf16 convolutions (one channels-last), norm and linear layers, and one fp32 parameter, which
    is stepped directly."""
    torch.manual_seed(0)
    module = torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3), torch.nn.GroupNorm(2, 8), torch.nn.Conv2d(8, 4, 1), torch.nn.Linear(4, 4)
    ).to(torch.bfloat16)
    module[0].to(memory_format=torch.channels_last)
    module.register_parameter("scale", torch.nn.Parameter(torch.randn(4)))
    return module


def _steps(modules, optimizers, n: int, seed: int) -> None:
    """n steps of each optimizer on the same gradients: bf16-representable values, so that the fp32
    reference's gradient equals `p.grad.float()` of the bf16 run exactly."""
    generator = torch.Generator().manual_seed(seed)
    for _ in range(n):
        grads = [torch.randn(p.shape, generator=generator) for p in modules[0].parameters()]
        for module in modules:
            for p, g in zip(module.parameters(), grads):
                p.grad = g.to(torch.bfloat16).to(p.dtype)
        for optimizer in optimizers:
            optimizer.step()


@pytest.mark.parametrize("kernel", KERNELS)
def test_masters_step_as_fp32_adamw_and_survive_a_checkpoint(kernel):
    low = _module()
    reference = copy.deepcopy(low).float()  # fp32 weights that start where the bf16 ones are
    optimizer = MasterWeightAdamW(low.parameters(), **ADAMW, **KERNELS[kernel])
    fp32_adamw = torch.optim.AdamW(reference.parameters(), **ADAMW, **KERNELS[kernel])
    _steps((low, reference), (optimizer, fp32_adamw), 4, seed=1)

    for p, ref in zip(low.parameters(), reference.parameters()):
        state = optimizer.state[p]
        if p.dtype == torch.float32:  # stepped as torch's AdamW steps it
            assert "master" not in state and torch.equal(p, ref)
            continue
        assert state["master"].dtype == state["exp_avg"].dtype == torch.float32
        assert torch.equal(state["master"], ref)  # the same kernel on the same fp32 numbers
        assert torch.equal(p, ref.to(torch.bfloat16))  # the model holds the masters rounded to nearest
        assert state["master"].stride() == p.stride()  # channels-last stays channels-last
        assert torch.equal(state["exp_avg_sq"], fp32_adamw.state[ref]["exp_avg_sq"])

    # Saved and loaded (as a checkpoint is) into a fresh model and optimizer, it continues bitwise.
    buffer = io.BytesIO()
    torch.save({"model": low.state_dict(), "optimizer": optimizer.state_dict()}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer)
    resumed = _module()
    resumed.load_state_dict(saved["model"])
    resumed_optimizer = MasterWeightAdamW(resumed.parameters(), **ADAMW, **KERNELS[kernel])
    resumed_optimizer.load_state_dict(saved["optimizer"])
    _steps((low, resumed), (optimizer, resumed_optimizer), 3, seed=2)
    for p, q in zip(low.parameters(), resumed.parameters()):
        assert torch.equal(p, q)
        for key, value in optimizer.state[p].items():
            assert torch.equal(resumed_optimizer.state[q][key], value)
            assert resumed_optimizer.state[q][key].dtype == value.dtype


def test_a_fp32_adamw_state_loads_with_masters_from_the_weights():
    """torch.optim.AdamW's state over fp32 weights, loaded over their bf16 copy: moments stay fp32,
    masters come from the bf16 weights."""
    fp32 = _module().float()
    fp32_adamw = torch.optim.AdamW(fp32.parameters(), **ADAMW)
    _steps((fp32,), (fp32_adamw,), 2, seed=3)
    low = copy.deepcopy(fp32).to(torch.bfloat16)
    optimizer = MasterWeightAdamW(low.parameters(), **ADAMW)
    optimizer.load_state_dict(fp32_adamw.state_dict())
    for p, ref in zip(low.parameters(), fp32.parameters()):
        assert torch.equal(optimizer.state[p]["exp_avg"], fp32_adamw.state[ref]["exp_avg"])
        assert torch.equal(optimizer.state[p]["master"], p.float())


# -- the EMA of the masters ---------------------------------------------------------------------------
class _OpCount(TorchDispatchMode):
    """How many times each aten op runs inside the block."""

    def __init__(self):
        super().__init__()
        self.ops: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        self.ops[name] = self.ops.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


def _masters(module, optimizer) -> list[torch.Tensor]:
    """Each parameter's master, or the fp32 parameter itself (`scale`)."""
    return [p if (m := master_of(optimizer, p)) is None else m for p in module.parameters()]


@pytest.mark.parametrize("start", [0, 2])
def test_fp32_ema_averages_the_masters_in_one_fused_update(start):
    """From ema_start (batch 0: the weights, before any master exists; batch 2: the masters), each
    update is one `_foreach_lerp_` of the masters (no cast, no per-tensor lerp), bitwise a per-tensor
    fp32 lerp of them by hand; also after a load has replaced every master."""
    low = _module()
    optimizer = MasterWeightAdamW(low.parameters(), **ADAMW)
    ema = EMA(smoothing=0.8, ema_start=start)
    ema._bind(low)
    ema.optimizers = [optimizer]
    ema.step(0, update=False)  # what FIT_START does
    weight = 1 - 0.8
    reference = [p.detach().to(torch.float32, copy=True) for p in low.parameters()] if start == 0 else None
    for batch in range(1, 7):
        if batch == 4:  # a load (a resume into this optimizer): every master is a new tensor
            old = [master_of(optimizer, p) for p in low.parameters()]
            optimizer.load_state_dict(copy.deepcopy(optimizer.state_dict()))
            new = [master_of(optimizer, p) for p in low.parameters()]
            assert all(m is not n and torch.equal(m, n) for m, n in zip(old, new) if m is not None)
        _steps((low,), (optimizer,), 1, seed=10 + batch)
        with _OpCount() as count:
            ema.step(batch)
        masters = _masters(low, optimizer)
        if batch == start:
            reference = [m.clone() for m in masters]
        elif reference is not None:
            reference = [torch.lerp(r, m, weight) for r, m in zip(reference, masters)]
            assert count.ops == {"_foreach_lerp_": 1}
        if reference is not None:
            averaged = list(ema.averaged_state().values())
            assert all(e.dtype == torch.float32 for e in averaged)
            assert all(torch.equal(e, r) for e, r in zip(averaged, reference))
    # Laid out like the parameters and masters (channels-last too): CUDA's fused lerp needs that.
    assert [e.stride() for e in averaged] == [p.stride() for p in low.parameters()]
    # Not the average of the bf16-rounded weights, which the EMA took before.
    assert any(not torch.equal(m, p.float()) for m, p in zip(masters, low.parameters()))


def test_without_masters_or_with_bf16_storage_the_ema_reads_the_weights():
    """No optimizer given (as before the first step): one converted copy per bf16 parameter, as
    before. bf16 storage: the bf16 weights in one fused update (`scale`, fp32, converted)."""
    low = _module()
    optimizer = MasterWeightAdamW(low.parameters(), **ADAMW)
    start = [p.detach().clone() for p in low.parameters()]
    plain, bf16 = EMA(smoothing=0.8), EMA(smoothing=0.8, storage="bf16")
    for ema in (plain, bf16):
        ema._bind(low)
        ema.step(0, update=False)
    bf16.optimizers = [optimizer]
    _steps((low,), (optimizer,), 1, seed=20)
    low_precision = sum(p.dtype == torch.bfloat16 for p in low.parameters())
    counted = ("_foreach_lerp_", "_to_copy", "lerp_")
    with _OpCount() as count:
        plain.step(1)
    assert [count.ops.get(op) for op in counted] == [1, low_precision, low_precision]
    with _OpCount() as count:
        bf16.step(1)
    assert [count.ops.get(op) for op in counted] == [1, 1, 1]
    weight = 1 - 0.8
    for e, s, p in zip(bf16.averaged_state().values(), start, low.parameters()):
        want = torch.lerp(s.to(torch.bfloat16), p.detach().to(torch.bfloat16), weight)
        assert e.dtype == torch.bfloat16 and torch.equal(e, want)


def test_offloaded_ema_copies_the_masters(monkeypatch):
    """The chunked offload path (a slow fake of the CUDA copies) reads the fp32 masters: the same
    average as on the parameters' device, bitwise."""
    monkeypatch.setattr(ema_offload, "OFFLOAD_CHUNK", 7)
    low = _module()
    optimizer = MasterWeightAdamW(low.parameters(), **ADAMW)
    plain, offloaded = EMA(smoothing=0.7), EMA(smoothing=0.7, offload=True)
    offloaded._copy = copier = _SlowCopy()
    for ema in (plain, offloaded):
        ema._bind(low)
        ema.optimizers = [optimizer]
        ema.step(0, update=False)
    for batch in range(1, 4):
        _steps((low,), (optimizer,), 1, seed=30 + batch)
        for ema in (plain, offloaded):
            ema.step(batch)
    assert copier.copies and set(offloaded._offload.staging) == {torch.float32}  # no bf16 chunk was copied
    for (name, a), b in zip(plain.averaged_state().items(), offloaded.averaged_state().values()):
        assert torch.equal(a, b), name


@pytest.mark.parametrize(
    "overrides, match",
    [
        (
            ["model.param_dtype=fp16"],
            r"^model.param_dtype='fp16'; choose one of \[None, 'float32', 'bfloat16'\]",
        ),
        (
            ["model.param_dtype=bfloat16", "optimizer._target_=torch.optim.Adam"],
            r"^'model.param_dtype' is bfloat16, which needs optimizer._target_ torch.optim.AdamW .* not "
            r"torch.optim.Adam$",
        ),
        (
            ["model.param_dtype=bfloat16", "trainer.precision=amp_fp16"],
            r"^'model.param_dtype' is bfloat16, which trains under trainer.precision amp_bf16 or fp32",
        ),
    ],
)
def test_config_errors_name_the_key(overrides, match):
    with pytest.raises(ConfigError, match=match) as error:
        parse_config(load_config(TINY, ["model.pretrained=null", *overrides]))
    assert "\n" not in str(error.value)


def test_build_model_refuses_other_dtypes():
    with pytest.raises(ValueError, match=r"^model.param_dtype='float16'; choose one of"):
        build_model("tiny", param_dtype="float16")


@pytest.mark.parametrize("preset", ["tiny", "sdxl-tiny", "mmdit-tiny"])
@pytest.mark.heavy
def test_every_family_trains_evaluates_and_samples_with_bf16_weights(preset):
    """Outside autocast (the CPU; sampling), the denoiser gets its inputs in bf16 and gives back a
    prediction the loss reads in fp32: the loss is the fp32 model's within bf16 rounding."""
    from models.engine.tokenizer import tokenize

    def build(param_dtype):
        torch.manual_seed(0)
        return build_model(preset, param_dtype=param_dtype)

    fp32, bf16 = build(None), build("bfloat16")
    assert {p.dtype for p in bf16.denoiser.parameters()} == {torch.bfloat16}
    captions = ["a red circle", "a blue square"]
    batch = {"image": torch.rand(2, 3, 32, 32, generator=torch.Generator().manual_seed(1)) * 2 - 1}
    batch["input_ids"] = tokenize(bf16.tokenizer, captions)
    if hasattr(bf16, "tokenizer_2"):
        batch["input_ids_2"] = tokenize(bf16.tokenizer_2, captions)
    losses = []
    for model in (fp32, bf16):
        torch.manual_seed(2)  # the same latents, noise and timesteps for both
        loss = model.loss(model(batch), batch)
        loss.backward()
        losses.append(loss.item())
    assert losses[1] == pytest.approx(losses[0], rel=0.01)  # measured: 4e-4
    assert all(p.grad.dtype == torch.bfloat16 for p in bf16.denoiser.parameters() if p.grad is not None)
    prediction, target, _ = bf16.eval_forward(batch)
    assert prediction.dtype == torch.bfloat16 and target.dtype == torch.float32
    images = bf16.generate(captions, num_inference_steps=2, height=32, width=32)
    assert images.dtype == torch.float32 and torch.isfinite(images).all()


# -- the tiny recipe ---------------------------------------------------------------------------------
BATCHES = 20
# Per loss, relative to the fp32 run's (the golden trace, tests/test_golden.py: the same run in fp32).
# The first batches differ by ~1e-4 (the initial weights rounded to bf16, a bf16 forward and
# backward); then the trajectories drift apart (bf16 gradients; weights that move only when their
# masters cross a bf16 rounding boundary): measured at most 0.84% (batch 5), 0.31% on average over
# the 20 batches. Plain AdamW on the bf16 weights, with no masters (updates below half a bf16 step
# lost), trains visibly slower: 1.9-3.4% above from batch 5 on, 2.2% on average.
RTOL, MEAN_RTOL = 0.02, 0.01


class _MastersEMA(Callback):
    """An fp32 EMA of the masters by hand, beside the run's: per-tensor `torch.lerp` after each batch
    (the EMA algorithm has updated by then: algorithms run before callbacks at an event)."""

    def fit_start(self, state, logger):
        self.average = {n: e.clone() for n, e in find_ema(state.algorithms).averaged_state().items()}

    def batch_end(self, state, logger):
        weight = 1 - find_ema(state.algorithms).smoothing
        optimizer, named = state.optimizers[0], dict(state.model.named_parameters())
        for name, average in self.average.items():
            self.average[name] = torch.lerp(average, optimizer.state[named[name]]["master"], weight)


@pytest.fixture(scope="module")
def bf16_run(shapes_mds, tmp_path_factory):
    """20 batches of the tiny recipe with bf16 weights, a checkpoint at batch 10 and an evaluation at
    the end (EMA weights swapped in), with an EMA of the masters by hand: (trainer, losses, folder)."""
    folder = tmp_path_factory.mktemp("bf16")
    overrides = [
        *tiny_run(shapes_mds, BATCHES),
        "model.param_dtype=bfloat16",
        f"+callbacks.loss_log={{_target_: extensions.callbacks.LossLog, path: {folder / 'loss.jsonl'}}}",
        f"trainer.save_folder={folder}",
        "trainer.save_filename='ba{batch}.pt'",
        "trainer.save_interval=10ba",
        f"+data.eval={{local: {shapes_mds / 'mds'}, resolution: 32}}",
        f"trainer.eval_interval={BATCHES}ba",
    ]
    trainer = build_trainer(load_config(TINY, overrides))
    trainer.state.callbacks.append(_MastersEMA())
    trainer.fit()
    trainer.close()
    return trainer, read_loss_log(folder / "loss.jsonl"), folder


@pytest.mark.fit
def test_bf16_weights_with_fp32_masters_train_like_fp32(bf16_run):
    import json

    trainer, losses, _ = bf16_run
    model, optimizer = trainer.state.model, trainer.state.optimizers[0]
    assert isinstance(optimizer, MasterWeightAdamW)
    trained = [p for p in model.parameters() if p.requires_grad]
    assert trained and all(p.dtype == torch.bfloat16 for p in model.unet.parameters())
    assert all(p.dtype == torch.float32 for p in model.vae.parameters())  # the frozen parts stay fp32
    for p in trained:
        assert optimizer.state[p]["master"].dtype == torch.float32
        assert torch.equal(p, optimizer.state[p]["master"].to(torch.bfloat16))
    assert math.isfinite(trainer.state.eval_metric_values["MeanSquaredError"])  # evaluated, EMA swapped in
    # The EMA (fp32) is that of the masters, bitwise, not of the bf16 weights.
    averaged = find_ema(trainer.state.algorithms).averaged_state()
    by_hand = next(c for c in trainer.state.callbacks if isinstance(c, _MastersEMA)).average
    assert averaged.keys() == by_hand.keys() and len(averaged) == len(trained)
    assert all(averaged[n].dtype == torch.float32 and torch.equal(averaged[n], by_hand[n]) for n in averaged)

    fp32 = json.loads(GOLDEN.read_text())["losses"]
    bf16 = [losses[b] for b in range(1, BATCHES + 1)]
    assert all(math.isfinite(x) for x in bf16)
    assert sum(bf16[-5:]) < 0.8 * sum(bf16[:5])  # it learns
    deviation = [abs(x / y - 1) for x, y in zip(bf16, fp32)]
    assert max(deviation) < RTOL, deviation
    assert sum(deviation) / BATCHES < MEAN_RTOL, deviation


@pytest.mark.fit
def test_resumed_bf16_run_continues_bitwise(bf16_run, shapes_mds, tmp_path):
    trainer, losses, folder = bf16_run
    overrides = [
        *tiny_run(shapes_mds, BATCHES),
        "model.param_dtype=bfloat16",
        f"+callbacks.loss_log={{_target_: extensions.callbacks.LossLog, path: {tmp_path / 'loss.jsonl'}}}",
        f"+trainer.load_path={folder / 'ba10.pt'}",
    ]
    resumed = build_trainer(load_config(TINY, overrides))
    resumed.fit()
    resumed.close()
    assert read_loss_log(tmp_path / "loss.jsonl") == {b: losses[b] for b in range(11, BATCHES + 1)}
    done, again = trainer.state.optimizers[0], resumed.state.optimizers[0]
    for p, q in zip(trainer.state.model.unet.parameters(), resumed.state.model.unet.parameters()):
        assert torch.equal(p, q)
        assert torch.equal(done.state[p]["master"], again.state[q]["master"])
    averaged = find_ema(trainer.state.algorithms).averaged_state()
    resumed_average = find_ema(resumed.state.algorithms).averaged_state()
    assert averaged.keys() == resumed_average.keys()
    assert all(torch.equal(averaged[n], resumed_average[n]) for n in averaged)


@pytest.mark.fit
def test_sampling_from_bf16_weights_and_their_checkpoint(bf16_run):
    trainer, _, folder = bf16_run
    model = trainer.state.model
    images = model.generate(["a red circle"], num_inference_steps=2, seed=0)
    assert images.dtype == torch.float32 and torch.isfinite(images).all()

    # Export and generate read a checkpoint's raw weights at full precision: the optimizer's fp32
    # masters, of which the bf16 weights are the rounding (not the bf16 weights cast up).
    loaded = load_model_from_checkpoint(folder / "ba20.pt", ema=False)
    assert all(p.dtype == torch.float32 for p in loaded.parameters())
    optimizer, finer = trainer.state.optimizers[0], 0
    for p, q in zip(model.unet.parameters(), loaded.unet.parameters(), strict=True):
        assert torch.equal(q, optimizer.state[p]["master"]) and torch.equal(q.to(p.dtype), p)
        finer += not torch.equal(q, p.float())
    assert finer > 0  # the masters hold what bf16 rounds away
    again = loaded.generate(["a red circle"], num_inference_steps=2, seed=0)
    assert torch.isfinite(again).all()
    # The EMA average is fp32 (of the fp32 masters), and stays fp32 in the loaded model.
    averaged = load_model_from_checkpoint(folder / "ba20.pt", ema=True)
    assert all(p.dtype == torch.float32 for p in averaged.unet.parameters())
