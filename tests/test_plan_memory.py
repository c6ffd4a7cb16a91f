"""The planner's memory columns (recipes/memory.py, recipes/footprint.py): against the measured peak of
a training step of the tiny models on the CPU, against the published arithmetic of sd3-medium and
Flux, and `--gpu-memory` refusing the shapes that do not fit.

How the peak is measured: torch.profiler's memory timeline (`export_memory_timeline`, which follows
every allocation and free of the CPU allocator during the profiled step) gives the rise of the step's
live bytes above where it started; what was alive before (weights, frozen parts, optimizer state, the
EMA: every tensor of the model, optimizer and EMA) is summed from those objects' storages, since the
profiler sees only the tensors a step touches (not, say, the VAE's decoder). tracemalloc cannot help
(torch allocates outside Python's allocator), and counting saved tensors would measure the planner's
method with itself.
"""

import json
import re

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from extensions.ema import find_ema
from recipes import load_config
from recipes.config import parse_config
from recipes.footprint import Footprint, footprint
from recipes.memory import COLUMNS, Precision, per_gpu, training_state
from recipes.plan import main
from recipes.reference_step import train_step
from recipes.trainer import trainer_kwargs
from tests.conftest import REPO, merged, tiny_run

# Published: SD3-medium's MMDiT has 2 B parameters (2.03 B: stabilityai's model card and the SD3 paper's
# depth-24 model); Flux.1's transformer 11,891,178,560 (black-forest-labs/FLUX.1-schnell's weights).
SD3_MEDIUM_PARAMS = 2.03e9
FLUX_PARAMS = 11_891_178_560
RATE = ["--img-per-sec-per-gpu", "1"]


def _plan(capsys, yaml, *args) -> list[dict]:
    main([str(yaml), *RATE, "--json", *args])
    return json.loads(capsys.readouterr().out)


def _bytes(tensors) -> int:
    """Bytes of the distinct storages under `tensors` (views and shared tensors counted once)."""
    return sum({id(s): s.nbytes() for s in (t.untyped_storage() for t in tensors)}.values())


def _rise(step, tmp_path) -> int:
    """How far the live bytes rise above where they started while `step()` runs."""
    with profile(
        activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True, with_stack=True
    ) as p:
        step()
    p.export_memory_timeline(str(tmp_path / "timeline.json"), device="cpu")
    _, sizes = json.loads((tmp_path / "timeline.json").read_text())  # [times, bytes by category]
    live = [sum(row) for row in sizes]  # the first row: what the step found alive that it touches
    return max(live) - live[0]


def _measured_step(run, tmp_path) -> dict[str, int]:
    """The run's own model, optimizer and EMA (recipes.trainer) and its data loader's batches: bytes by
    the planner's columns, and the `peak` of a whole step (recipes/reference_step.py train_step, as
    Composer runs it). The activations are measured apart: the rise of one microbatch's forward and
    backward, with the gradients already there."""
    kwargs = trainer_kwargs(run, world_size=1)
    model, optimizer, loader = kwargs["model"], kwargs["optimizers"], kwargs["train_dataloader"]
    ema = find_ema(kwargs["algorithms"])
    ema.optimizers = [optimizer]  # what Composer's FIT_START hands it
    ema.bind(model)
    ema.step(0, update=False)
    microbatch = kwargs.get("device_train_microbatch_size") or loader.batch_size
    batches = iter(loader)
    train_step(model, next(batches), optimizer, ema=ema, step=0, microbatches=loader.batch_size // microbatch)
    trainable = [p for p in model.parameters() if p.requires_grad]
    state = [v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v) and v.dim()]
    measured = {
        "weights": _bytes(trainable),
        "gradients": _bytes(p.grad for p in trainable),
        "optimizer": _bytes(state),
        "ema": _bytes(ema.averaged_state().values()),
        "frozen": _bytes(p for p in model.parameters() if not p.requires_grad),
    }
    batch = next(batches)
    part = {k: v[:microbatch] for k, v in batch.items()}
    measured["activations"] = _rise(lambda: model.loss(model(part), part).backward(), tmp_path)

    optimizer.zero_grad(set_to_none=True)  # what the step does first, here before the profile
    before = _bytes([*model.state_dict(keep_vars=True).values(), *state, *ema.averaged_state().values()])
    step = lambda: train_step(  # noqa: E731
        model, batch, optimizer, ema=ema, step=1, microbatches=loader.batch_size // microbatch
    )
    measured["peak"] = before + _rise(step, tmp_path)
    return measured


TINY_RUNS = {  # recipe, overrides: a UNet on whole batches, an MMDiT on microbatches with bf16 weights
    "unet": ("tiny-cpu", []),
    "unet-recomputed": ("tiny-cpu", ["+model.gradient_checkpointing=true"]),
    "mmdit-bf16-microbatches": (
        "tiny-mmdit-cpu",
        [
            "+model.param_dtype=bfloat16",
            "global_train_batch_size=32",
            "+trainer.device_train_microbatch_size=16",
        ],
    ),
    # torchao's Float8Linear (emulated on the CPU) saves what it casts from, not the float8 casts
    "mmdit-fp8": ("tiny-mmdit-cpu", ["+model.fp8=true"]),
}


@pytest.mark.heavy  # ~12 CPU-seconds each: the profiler's memory timeline of two profiled steps
@pytest.mark.parametrize("case", TINY_RUNS)
def test_the_memory_columns_are_the_measured_peak_of_a_tiny_step(case, shapes_mds, tmp_path, capsys):
    """The planner's row for one CPU against one training step of the same recipe, measured: the
    arithmetic columns to the byte's percent, the activations and the total within 25% (the issue's
    bound; measured 1-13% on 2026-11-27)."""
    recipe, overrides = TINY_RUNS[case]
    yaml, overrides = REPO / f"yamls/{recipe}.yaml", merged(*tiny_run(shapes_mds, 2), *overrides)
    (row,) = _plan(capsys, yaml, "--gpus", "1", *overrides)
    (planned,) = row["memory"]
    measured = _measured_step(parse_config(load_config(yaml, overrides)), tmp_path)
    assert (planned["shard"], planned["replicate"], planned["fits"]) == (1, 1, True)
    for column in ("weights", "gradients", "optimizer", "ema", "frozen"):
        assert planned[column] * 1e9 == pytest.approx(measured[column], rel=0.01), column
    assert planned["activations"] * 1e9 == pytest.approx(measured["activations"], rel=0.25)
    assert planned["total"] * 1e9 == pytest.approx(measured["peak"], rel=0.25)
    assert measured["activations"] > 0.3 * measured["peak"]  # large enough to be tested by the bound


@pytest.mark.heavy
def test_sd3_medium_and_flux_against_the_published_arithmetic(capsys):
    """fp32 weights, gradients and AdamW's two moments: 16 bytes per parameter, so ~32.5 GB for SD3
    medium's 2.03 B (yamls/sd3-medium.yaml's comment) and ~190 GB for Flux's 11.9 B (issue 39). No Flux
    preset exists yet: its count goes through the same arithmetic, and once a preset builds it,
    recipes/footprint.py counts it from the model like sd3-medium's here."""
    counted = footprint("sd3-medium", 256, bf16=True).trainable  # the recipe's (amp_bf16), counted once
    assert counted == pytest.approx(SD3_MEDIUM_PARAMS, rel=0.005)
    (row,) = _plan(capsys, REPO / "yamls/sd3-medium.yaml", "--gpus", "1", "--shard", "1")
    (one_gpu,) = row["memory"]
    state = one_gpu["weights"] + one_gpu["gradients"] + one_gpu["optimizer"]
    assert state == pytest.approx(32.5, abs=0.1) and state * 1e9 == pytest.approx(16 * counted)

    flux = training_state(FLUX_PARAMS)
    assert sum(flux.values()) / 1e9 == pytest.approx(190, rel=0.01)
    assert sum(training_state(FLUX_PARAMS, bf16_weights=True).values()) == sum(flux.values())  # + masters
    # Sharded over a node of 8, without the gathered units or activations: an eighth on each GPU.
    eighth = per_gpu(Footprint(FLUX_PARAMS, 0, 0, 0), Precision(), shard=8, gpus=16, microbatch=1)
    assert eighth["total"] / 1e9 == pytest.approx(190 / 8, rel=0.01)


def test_what_divides_by_the_shard_and_what_does_not(capsys):
    """sd3-medium on 8 GPUs at each shard: weights, gradients, optimizer state divide by the shard (the
    weights plus the units FSDP gathers whole), DDP (shard 1) holds the gradients twice (its buckets)
    but one GPU alone does not, and the frozen parts and activations are the same at every shard."""
    (row,) = _plan(capsys, REPO / "yamls/sd3-medium.yaml", "--gpus", "8", "--shard", "1", "2", "4", "8")
    ddp, *sharded = row["memory"]
    assert [m["shard"] for m in row["memory"]] == [1, 2, 4, 8] and ddp["replicate"] == 8
    assert ddp["gradients"] == pytest.approx(2 * ddp["weights"])
    for m in sharded:
        assert m["optimizer"] * m["shard"] == pytest.approx(ddp["optimizer"])
        assert m["gradients"] * m["shard"] == pytest.approx(ddp["weights"])
        gathered = m["weights"] - ddp["weights"] / m["shard"]
        assert gathered == pytest.approx(sharded[0]["weights"] - ddp["weights"] / 2) and gathered > 0
        assert (m["frozen"], m["activations"]) == (ddp["frozen"], ddp["activations"])
        assert m["total"] == pytest.approx(sum(m[c] for c in COLUMNS))
    (alone,) = _plan(capsys, REPO / "yamls/sd3-medium.yaml", "--gpus", "1", "--shard", "1")[0]["memory"]
    assert alone["gradients"] == alone["weights"]


@pytest.mark.heavy
def test_gpu_memory_refuses_the_shapes_that_do_not_fit(capsys, caplog):
    yaml = str(REPO / "yamls/sd3-medium.yaml")
    with pytest.raises(SystemExit) as exit_:
        main([yaml, *RATE, "--gpu-memory", "0"])
    assert (
        exit_.value.code == 2
        and "error: argument --gpu-memory: must be a positive, finite number of GB, got 0"
        in capsys.readouterr().err
    )
    shapes = ["--gpus", "8", "--shard", "1", "2", "4", "8"]
    totals = {
        m["shard"]: m["total"] for m in _plan(capsys, yaml, *shapes, "--gpu-memory", "1000")[0]["memory"]
    }
    assert totals[1] > totals[2] > totals[4] > totals[8]

    # Some listed shapes fit: those that do not are marked, the smallest that fits is named, status 0.
    limit = (totals[2] + totals[4]) / 2
    main([yaml, *RATE, *shapes, "--gpu-memory", str(limit)])
    out = capsys.readouterr().out.splitlines()
    rows = out[out.index(next(line for line in out if line.startswith("memory per GPU"))) + 2 :][:4]
    assert [(r.split()[1], r.split()[-1]) for r in rows] == [
        ("1", "NO"),
        ("2", "NO"),
        ("4", "yes"),
        ("8", "yes"),
    ]
    assert out[-1] == (
        f"at 8 GPUs: does not fit in {limit:g} GB per GPU (--gpu-memory): shard 1 needs {totals[1]:.1f} GB, "
        f"shard 2 needs {totals[2]:.1f} GB; the smallest listed shard that fits is 4"
    )

    # The one shape asked for does not fit: status 1, and the line names the smallest that would.
    with pytest.raises(SystemExit) as exit_:
        main([yaml, *RATE, "--gpus", "8", "--shard", "1", "--gpu-memory", str(limit)])
    assert exit_.value.code == 1
    assert (
        capsys.readouterr()
        .out.splitlines()[-1]
        .endswith(f"the smallest shard that fits is 4 ({totals[4]:.1f} GB: parallelism.shard=4)")
    )

    # Nothing up to a node fits (the recipe's own shape: Composer's FSDP over all 8): what else to change.
    with pytest.raises(SystemExit) as exit_:
        main([yaml, *RATE, "--gpus", "8", "--json", "--gpu-memory", str(totals[8] - 1)])
    assert exit_.value.code == 1
    (own,) = json.loads(capsys.readouterr().out)[0]["memory"]
    assert (own["shard"], own["fits"]) == (8, False)
    assert (
        f"no shard up to a node (8 GPUs) fits ({totals[8]:.1f} GB at shard 8" in caplog.text
    )  # JSON: the log


def _advice(capsys, *args) -> str:
    """The memory line of a count that does not fit: main's last line, with exit status 1."""
    with pytest.raises(SystemExit) as exit_:
        main([str(REPO / "yamls/tiny-mmdit-cpu.yaml"), *RATE, "--gpus", "8", *TINY_BATCH, *args])
    assert exit_.value.code == 1
    line = capsys.readouterr().out.splitlines()[-1]
    assert line.startswith("at 8 GPUs: does not fit in "), line
    return line


# The tiny transformer at 32 per GPU, microbatches of at most 32; its recipe's own settings: it already
# shards over the node (8 GPUs) and recomputes its blocks.
TINY_BATCH = ["global_train_batch_size=256", "trainer.device_train_microbatch_size=32"]
SHARDED_RECOMPUTED = ["parallelism.shard=node", "model.activation_checkpointing=blocks"]


@pytest.mark.heavy
def test_the_advice_names_only_what_the_recipe_does_not_have(capsys):
    """Issue 47: where nothing fits, the advice named sharding and recomputed blocks to a recipe that
    had both. Now it names the one change left (a smaller microbatch), and, where nothing it knows of
    would fit, says so."""
    tiny = str(REPO / "yamls/tiny-mmdit-cpu.yaml")
    (own,) = _plan(capsys, tiny, "--gpus", "8", *TINY_BATCH, *SHARDED_RECOMPUTED)[0]["memory"]
    one = TINY_BATCH[:1] + ["trainer.device_train_microbatch_size=1"]
    (least,) = _plan(capsys, tiny, "--gpus", "8", *one, *SHARDED_RECOMPUTED)[0]["memory"]
    assert (own["shard"], own["microbatch"], least["microbatch"]) == (8, 32, 1)
    assert least["total"] < own["total"]

    # Between the two: a smaller microbatch fits, and it is the only change named.
    per_sample = (own["activations"] - least["activations"]) / 31
    limit = least["total"] + 16.5 * per_sample  # microbatch 16 fits (16 - 1 more samples), 32 does not
    line = _advice(capsys, *SHARDED_RECOMPUTED, "--gpu-memory", f"{limit:.6f}")
    assert re.search(r"; it fits with trainer.device_train_microbatch_size=16 \(0\.0\d+ GB\)$", line), line
    assert f"no shard up to a node (8 GPUs) fits ({own['total']:.2g} GB at shard 8" in line
    assert "activation_checkpointing" not in line and "parallelism.shard" not in line

    # Without the recomputed blocks, recomputing them is a way too (as is a smaller microbatch).
    line = _advice(capsys, "parallelism.shard=node", "--gpu-memory", f"{own['total'] * 1.01:.6f}")
    assert "it fits with trainer.device_train_microbatch_size=" in line
    assert line.endswith(f", or with model.activation_checkpointing=blocks ({own['total']:.2g} GB)"), line

    # Below the least any known setting needs: said plainly, with that least and what it is made of.
    line = _advice(capsys, *SHARDED_RECOMPUTED, "--gpu-memory", "0.01")
    said = line.split("per GPU (--gpu-memory): ")[1]
    assert said.startswith(
        f"shard 8 needs {own['total']:.2g} GB; no setting we know fits this in 0.01 GB per GPU: the least "
        f"it needs is {least['total']:.2g} GB (weights {least['weights']:.2g}, gradients "
    ), said
    assert said.endswith(
        f"activations {least['activations']:.2g} GB), with shard 8 (as the run is), microbatch 1 "
        "(trainer.device_train_microbatch_size=1), activations recomputed (as the run is); what is left: "
        "GPUs with more memory, a shard across nodes (over 8 GPUs), or a smaller model or resolution"
    ), said


# docs/benchmarks.md "GPU figures", 2026-11-26: sd2-base on one H100 80GB, precomputed latents, one
# microbatch a step; torch.cuda.max_memory_allocated in GiB.
H100_PEAKS_GIB = {
    ("eager", 256, 32): 20.4,  # fp32 weights under bf16 autocast
    ("compiled", 256, 32): 20.7,  # bf16 weights with fp32 masters, compiled, CUDA graphs
    ("eager", 512, 16): 27.3,
    ("compiled", 512, 16): 26.5,
}


@pytest.mark.parametrize("step, resolution, microbatch", H100_PEAKS_GIB)
@pytest.mark.heavy
def test_the_planner_bounds_the_peaks_measured_on_an_h100(step, resolution, microbatch, capsys):
    """The planner's bf16 activations against the GPU: its total is at or above each measured peak,
    by at most 10% (it counts the gradients beside all the activations, which one microbatch a step
    never holds at once: the backward frees the one as it writes the other)."""
    batch = [f"global_train_batch_size={microbatch}", f"trainer.device_train_microbatch_size={microbatch}"]
    overrides = [f"_step={step}", f"data.train.resolution={resolution}", *batch]
    (row,) = _plan(capsys, REPO / "yamls/sd2-base.yaml", "--gpus", "1", *overrides)
    measured = H100_PEAKS_GIB[step, resolution, microbatch] * 2**30 / 1e9
    assert measured <= row["memory"][0]["total"] <= 1.10 * measured


def test_a_resolution_the_model_cannot_take_is_a_config_error(capsys):
    with pytest.raises(SystemExit, match="config error: data.train.resolution=32: resolution 32 for preset "):
        main([str(REPO / "yamls/sd2-base.yaml"), *RATE, "--gpus", "8", "data.train.resolution=32"])
