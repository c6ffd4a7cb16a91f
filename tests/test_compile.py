"""`model.compile_unet` on the CPU: what a GPU run with torch.compile and CUDA graphs relies on
(issue 29) and a CPU can check. The denoiser's training step is one graph with no break; a run
compiles its training graph in the first batch, its evaluation graph at the first evaluation, and
nothing after; each aspect-ratio bucket shape compiles one static graph, also past torch's default
limit of 8; under CUDA graphs every denoiser call marks a new CUDA-graph step before its graph
runs; and the compiled model trains to eager's losses.

Recompiles are decided by dynamo's guards, whatever the backend, so most tests compile with a
backend that records the graphs dynamo hands over and runs them as they are; only the loss-curve
test pays for inductor's code generation.
"""

import copy
import gc

import pytest
import torch
from composer.core import Callback

from bench.narrow import PRESET as NARROW
from bench.narrow import register_preset
from compat.torch import counters, explain, is_compiled, list_mode_options
from extensions.persistent_grads import PersistentGradients
from models import MODELS, PRESETS, build
from models.engine.tokenizer import tokenize
from models.training.torch_compile import CUDAGRAPH_MODES, uses_cudagraphs
from recipes import ConfigError, build_trainer, load_config, parse_config
from tests.conftest import REPO, tiny_run


@pytest.fixture(scope="module", autouse=True)
def narrow_preset():
    """sd2-narrow (sd2-base's UNet blocks at small widths, bench/narrow.py) for this module's tests
    only: elsewhere code that goes through every preset (export's preset inference) sees the shipped
    ones."""
    register_preset()
    yield
    PRESETS.pop(NARROW)
    MODELS.pop(NARROW)


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Each test starts from no compiled code and no counts, and leaves none behind."""
    torch.compiler.reset()
    counters.clear()
    yield
    torch.compiler.reset()
    counters.clear()


class Recorder:
    """A torch.compile backend that keeps the example inputs of every graph dynamo compiles and
    runs each graph unchanged, noting "graph" in `events` at each run."""

    def __init__(self, events: list | None = None):
        self.inputs, self.events = [], events if events is not None else []

    def __call__(self, graph, example_inputs, **options):
        self.inputs.append(example_inputs)

        def run(*args):
            self.events.append("graph")
            return graph.forward(*args)

        return run

    def static(self, i: int) -> bool:
        """Whether graph i was compiled for fixed shapes (no symbolic size among its inputs)."""
        return not any(
            isinstance(x, torch.SymInt) or any(isinstance(d, torch.SymInt) for d in getattr(x, "shape", ()))
            for x in self.inputs[i]
        )

    def shapes(self, i: int) -> set[tuple[int, ...]]:
        return {tuple(x.shape) for x in self.inputs[i] if isinstance(x, torch.Tensor)}


def _batch(model, height: int = 8, width: int = 8, seed: int = 0) -> dict:
    """Two samples of precomputed latent moments (mean and logvar) and captions' token ids."""
    generator = torch.Generator().manual_seed(seed)
    captions = ["a red circle", "a blue square"]
    batch = {
        "latents": torch.randn(2, 2 * model.vae.config.latent_channels, height, width, generator=generator),
        "input_ids": tokenize(model.tokenizer, captions),
    }
    if hasattr(model, "tokenizer_2"):  # SDXL's and SD3's second text encoder
        batch["input_ids_2"] = tokenize(model.tokenizer_2, captions)
    return batch


def _step(model, batch, seed: int = 1) -> torch.Tensor:
    """Forward, loss and backward of a training step with the same random draws every time."""
    torch.manual_seed(seed)
    loss = model.loss(model(batch), batch)
    loss.backward()
    return loss.detach()


def _one_graph_without_a_break() -> None:
    """What dynamo compiled since the last reset was one graph, with no break. A graph break splits
    the step into graphs with eager Python between them: host time on a launch-bound GPU step, and
    CUDA graphs captured piecewise."""
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] == 1  # the compiled path really ran, compiled once


# The UNets' training steps are checked by the tests that train them compiled (tiny: the aot_eager
# test; sd2-base's structure and options: the inductor test).
@pytest.mark.parametrize("preset", ["sdxl-tiny", "mmdit-tiny"])
@pytest.mark.heavy
def test_the_denoisers_training_step_is_one_graph_without_a_break(preset):
    torch.manual_seed(0)
    model = build(preset).train()
    calls = []
    hook = model.denoiser.register_forward_pre_hook(
        lambda module, args, kwargs: calls.append((args, kwargs)), with_kwargs=True
    )
    model(_batch(model))
    hook.remove()
    (args, kwargs), *more = calls
    assert not more, "the denoiser runs once per training forward"
    explanation = explain(model.denoiser)(*args, **kwargs)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    assert explanation.graph_count == 1


class CompileCounts(Callback):
    """After each training batch: the graphs and the frames dynamo has compiled; and the number of
    evaluation batches."""

    def __init__(self):
        self.per_batch, self.eval_batches = [], 0

    def batch_end(self, state, logger):
        self.per_batch.append((counters["stats"]["unique_graphs"], counters["frames"]["total"]))

    def eval_batch_end(self, state, logger):
        self.eval_batches += 1


@pytest.mark.fit
def test_nothing_recompiles_after_the_first_batch(shapes_mds, monkeypatch):
    """21 batches of the tiny recipe (EMA, NaN guard, monitors; 2 microbatches a batch) through
    Composer with the compiled UNet under the CUDA-graph mode's options, evaluated every 5 batches
    (eval mode, no grad, the EMA's weights): the training graph compiles in the first batch, the
    evaluation's at the first evaluation, and nothing after; every denoiser call marks its
    CUDA-graph step."""
    marks = []
    monkeypatch.setattr(torch.compiler, "cudagraph_mark_step_begin", lambda: marks.append(1))
    overrides = [
        *tiny_run(shapes_mds, 21),
        "trainer.device_train_microbatch_size=8",  # of 16
        # The eager backend ignores the mode (with a warning); the mode installs the step marks.
        "model.compile_unet={backend:eager,mode:reduce-overhead}",
        f"+data.eval.local={shapes_mds / 'mds'}",
        "+data.eval.resolution=32",
        "trainer.eval_interval=5ba",
    ]
    trainer = build_trainer(load_config(REPO / "yamls/tiny-cpu.yaml", overrides))
    counts = CompileCounts()
    # Under CUDA graphs the gradients live in buffers of their own (extensions/persistent_grads.py).
    (persistent,) = [c for c in trainer.state.callbacks if isinstance(c, PersistentGradients)]
    own_buffers = []
    counts.after_backward = lambda state, logger: own_buffers.append(
        all(p.grad is b for p, b in zip(state.model.unet.parameters(), persistent.buffers, strict=True))
    )
    trainer.state.callbacks.append(counts)
    trainer.fit()
    trainer.close()
    assert own_buffers == [True] * 2 * 21  # after every microbatch's backward
    del trainer
    gc.collect()  # the streaming dataset's shared memory
    # (graphs, frames): the UNet's training forward, then its evaluation one after batch 5's eval.
    assert counts.per_batch == [(1, 1)] * 5 + [(2, 2)] * 16, counts.per_batch
    assert counts.eval_batches == 5 * 4  # 64 samples in 16s after batches 5, 10, 15, 20 and at the end
    assert len(marks) == 2 * 21 + counts.eval_batches


# Latent sizes of aspect-ratio buckets (the tiny UNet takes multiples of 2): nine, one past torch's
# default recompile limit of 8.
BUCKETS = [(8, 8), (8, 12), (12, 8), (6, 10), (10, 6), (8, 10), (10, 8), (6, 12), (12, 6)]


def _train_on_shapes(shapes) -> Recorder:
    recorder = Recorder()
    torch.manual_seed(0)
    model = build("tiny", compile_unet={"backend": recorder}).train()
    for height, width in shapes:
        _step(model, _batch(model, height, width))
    assert len(recorder.events) == len(shapes)  # every step ran a compiled graph, none eagerly
    return recorder


def _one_static_graph_each(recorder: Recorder, shapes) -> None:
    assert len(recorder.inputs) == len(shapes)
    for i, (height, width) in enumerate(shapes):
        assert recorder.static(i)
        assert (2, 4, height, width) in recorder.shapes(i)  # the noisy latents


@pytest.mark.heavy  # 9 compilations: 14 s
def test_each_bucket_shape_compiles_one_static_graph_once_also_past_torchs_limit():
    """Shapes seen again, interleaved, reuse their graph; each new one gets its own static graph,
    never a dynamic-shape one. Past 8 graphs per compiled function (torch's default recompile limit)
    dynamo would run new shapes eagerly, with a warning only; build_model raises the limit."""
    a, b, c = BUCKETS[:3]
    _one_static_graph_each(_train_on_shapes([a, b, a, c, b, a, c, *BUCKETS[3:]]), BUCKETS)


@pytest.mark.heavy  # a control for the check above, not a property of ours
def test_torchs_default_would_compile_the_second_shape_dynamic():
    """What `dynamic=False` (build_model's default) prevents: the check above can see it."""
    recorder = Recorder()
    model = build("tiny", compile_unet={"backend": recorder, "dynamic": None}).train()
    for height, width in BUCKETS[:2]:
        _step(model, _batch(model, height, width))
    assert recorder.static(0) and not recorder.static(1)


def test_the_cuda_graph_modes_are_torchs():
    assert {mode for mode, options in list_mode_options().items() if options.get("triton.cudagraphs")} == set(
        CUDAGRAPH_MODES
    )
    assert uses_cudagraphs({"mode": "reduce-overhead"}) and uses_cudagraphs({"mode": "max-autotune"})
    assert uses_cudagraphs({"options": {"triton.cudagraphs": True}})
    assert uses_cudagraphs({"backend": "cudagraphs"})
    assert not uses_cudagraphs({}) and not uses_cudagraphs({"mode": "max-autotune-no-cudagraphs"})
    assert not uses_cudagraphs({"options": {"triton.cudagraphs": False}})


@pytest.mark.parametrize("cudagraphs", [True, False])
@pytest.mark.heavy
def test_under_cuda_graphs_each_call_marks_a_step_before_its_graph_runs(cudagraphs, monkeypatch):
    """The mark must come before the compiled graph of the same call, outside it (a mark traced
    into the graph, or replayed after it, would start the new step too late or mid-step)."""
    events = []
    monkeypatch.setattr(torch.compiler, "cudagraph_mark_step_begin", lambda: events.append("mark"))
    options = {"mode": "reduce-overhead"} if cudagraphs else {}
    model = build("tiny", compile_unet={"backend": Recorder(events), **options}).train()
    for seed in range(3):
        _step(model, _batch(model), seed)
    assert events == (["mark", "graph"] if cudagraphs else ["graph"]) * 3


@pytest.mark.subprocess  # torch.compile starts inductor's compile workers
def test_compiled_unet_trains_like_the_eager_one():
    """One forward + backward through the torch.compile'd UNet gives the eager UNet's loss and gradients.

    Backend aot_eager: dynamo captures the forward graph and AOTAutograd the backward one, as with
    the default inductor backend, but without generating C++ (see the next test for inductor).
    """
    torch.manual_seed(0)
    eager = build("tiny")
    compiled = build("tiny", compile_unet={"backend": "aot_eager"})
    assert is_compiled(compiled.unet)  # nn.Module.compile, in place
    assert compiled.state_dict().keys() == eager.state_dict().keys()  # checkpoints/export unchanged
    compiled.load_state_dict(eager.state_dict())
    batch = _batch(eager)
    results = []
    for model in (eager, compiled):
        model.train()
        torch.manual_seed(1)  # the same latents sample, noise and timesteps
        outputs = model(batch)
        loss = model.loss(outputs, batch)
        loss.backward()
        results.append((outputs[0].detach(), loss.detach(), [p.grad for p in model.unet.parameters()]))
    _one_graph_without_a_break()
    (eager_out, eager_loss, eager_grads), (out, loss, grads) = results
    assert torch.isfinite(loss) and not torch.equal(out, torch.zeros_like(out))
    torch.testing.assert_close(out, eager_out, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(loss, eager_loss, rtol=1e-4, atol=1e-6)
    for grad, eager_grad in zip(grads, eager_grads, strict=True):
        torch.testing.assert_close(grad, eager_grad, rtol=1e-3, atol=1e-5)


def _losses(model, steps: int, dtype: torch.dtype | None = None) -> list[float]:
    """`steps` training steps with AdamW from the model's weights, on the same batches and draws
    (under autocast to `dtype` if given)."""
    model.train()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    losses = []
    for step in range(steps):
        with torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
            losses.append(_step(model, _batch(model, seed=step), seed=100 + step).item())
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return losses


# (preset, torch.compile options, other build options, autocast dtype): inductor itself on the tiny
# preset, in fp32; on sd2-narrow, sd2-base's block structure with its denoiser options (Composer's
# low-precision norms, channels-last) under the bf16 autocast of its amp_bf16 precision, inductor's
# decompositions and partitioner with ATen's kernels (aot_eager_decomp_partition), because building
# inductor's C++ kernels for that structure took 170-300 s on 2 cores (tiny: 80-90 s), every CI run,
# and a GPU run generates Triton kernels instead anyway.
SD2_OPTIONS = {"low_precision_norms": "amp_bf16", "channels_last": True}
INDUCTOR_CASES = [
    ("tiny", True, {}, None),
    (NARROW, {"backend": "aot_eager_decomp_partition"}, SD2_OPTIONS, torch.bfloat16),
]


@pytest.mark.slow
@pytest.mark.subprocess  # inductor compiles its C++ kernels in worker processes
@pytest.mark.parametrize(
    ("preset", "compile_unet", "options", "dtype"), INDUCTOR_CASES, ids=[c[0] for c in INDUCTOR_CASES]
)
def test_inductor_trains_to_the_eager_losses_in_one_graph(preset, compile_unet, options, dtype):
    """The default backend, which a GPU run uses (there with Triton kernels), through 10 AdamW steps
    of forward, loss and backward: one graph, no break, and the same losses as eager within bf16's
    precision. bf16 keeps 8 significant bits (a relative spacing of 2^-8 = 0.4%), and a GPU run
    computes in it, so rtol 1e-2 is a couple of bf16 roundings. Measured: tiny in fp32 agrees to
    about 1e-6, sd2-narrow under bf16 autocast to 0.03-0.18% (2026-11-26).

    Slow the first time: building inductor's C++ kernels for tiny took 80-90 s on 2 cores, by load;
    its on-disk cache (/tmp/torchinductor_$USER) makes later runs about 8 s.
    """
    torch.manual_seed(0)
    eager = build(preset, **options)
    compiled = build(preset, compile_unet=compile_unet, **options)
    compiled.load_state_dict(eager.state_dict())
    expected = _losses(eager, 10, dtype)
    losses = _losses(compiled, 10, dtype)
    _one_graph_without_a_break()
    torch.testing.assert_close(losses, expected, rtol=1e-2, atol=0)


def test_gradients_accumulate_in_buffers_of_their_own_across_microbatches_and_batches():
    """Under CUDA graphs a gradient that autograd took over from the backward's output would live in
    the graph's memory, which the next microbatch's replay overwrites (extensions/persistent_grads.py).
    With PersistentGradients each gradient is the parameter's own buffer, the same one every
    microbatch and batch, and holds what unset gradients would: the sum over the microbatches."""
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.SiLU(), torch.nn.Linear(8, 2))
    reference = copy.deepcopy(module)
    persistent = PersistentGradients(module)
    params = list(module.parameters())
    for _ in range(3):  # batches
        inputs = torch.randn(2, 3, 4)  # 2 microbatches of 3
        for model in (module, reference):
            for p in model.parameters():
                p.grad = None  # Composer's zero_grad(set_to_none=True) before each batch
        for microbatch in inputs:
            persistent.before_forward(None, None)
            module(microbatch).square().sum().backward()
            reference(microbatch).square().sum().backward()
        assert all(p.grad is buffer for p, buffer in zip(params, persistent.buffers, strict=True))
        for p, q in zip(params, reference.parameters(), strict=True):
            torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0)


def test_cuda_graphs_with_fsdp_is_one_config_error():
    fsdp = "+trainer.parallelism_config={fsdp: {sharding_strategy: SHARD_GRAD_OP}}"
    cudagraphs = "model.compile_unet={mode: reduce-overhead}"
    match = r"^'model.compile_unet' is .*reduce-overhead.* with trainer"
    with pytest.raises(ConfigError, match=match) as error:
        parse_config(load_config(REPO / "yamls/tiny-cpu.yaml", [fsdp, cudagraphs]))
    assert "\n" not in str(error.value)
    parse_config(load_config(REPO / "yamls/tiny-cpu.yaml", [fsdp, "model.compile_unet=true"]))  # no graphs
