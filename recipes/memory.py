"""Per-GPU memory of a training run: the arithmetic behind `python -m recipes.plan`'s memory table.

Per trained parameter (torch.optim.AdamW; extensions/master_weights.py for bf16 weights):
  fp32 weights: 4 bytes of weight, 4 of gradient, 8 of AdamW moments (exp_avg, exp_avg_sq): 16;
  bf16 weights (model.param_dtype: bfloat16): 2 + 2 + 8 + 4 of fp32 master: 16 as well;
  the EMA (extensions/ema.py): 4 bytes in fp32 storage, 2 in bf16, none on the GPU when offloaded.
Sharded over `shard` GPUs (FSDP: parallelism.shard), all of these divide by shard (the EMA is built
from the local shards), and FSDP holds the root unit's and two units' weights whole in the compute
dtype (the unit computing and the one prefetched; recipes/footprint.py counts them). Unsharded on
several GPUs (DDP) the gradients are held twice: Composer wraps the model with DistributedDataParallel's
defaults (composer/distributed/dist_strategy.py), whose all-reduce buckets are a second copy of them.
Frozen parts (VAE, text encoders, SD3's T5 when loaded) are fp32 and whole on every GPU, also when
training on precomputed latents: the model keeps them to encode prompts and decode sample grids. A
LoRA run's `model.base_weights` stores its frozen denoiser and large encoders in bf16 (2 bytes a
parameter), float8 (1, and an fp32 scale per row) or NF4 (0.5, and 1/64 of int8 block scales):
models/training/base_weights.py; recipes/footprint.py counts them layer by layer.
Activations (recipes/footprint.py: per sample, times the microbatch) do not divide by shard.

Left out, hence the margin below: the CUDA context and NCCL buffers, the allocator's fragmentation,
the 4-byte fp32 gradient copy MasterWeightAdamW makes while it steps (after the backward has freed the
activations) and the frozen encoders' no-grad forward on images. GB are 10^9 bytes throughout.
Counting every gradient beside every activation is right under gradient accumulation and a little
over with one microbatch a step: sd2-base's totals are 4-7% above its H100 peaks measured so
(docs/benchmarks.md; tests/test_plan_memory.py holds them to 10%).
"""

import inspect
from dataclasses import dataclass

from models.engine.family import T5_ENCODER
from recipes.config import ConfigError
from recipes.footprint import Footprint, footprint

# An H100 or A100 80GB: 80 GiB (85.9e9 bytes), of which 80e9 leaves ~6 GB for what is left out above.
DEFAULT_GPU_MEMORY = 80.0
DEFAULT_GPUS_PER_NODE = 8  # the nodes the recipes are planned for (8x H100 or A100); `shard: node`
COLUMNS = ["weights", "gradients", "optimizer", "ema", "frozen", "activations"]
ADAMW_MOMENTS = 8  # exp_avg and exp_avg_sq, fp32, whatever the weights' dtype
FP32_MASTER = 4  # MasterWeightAdamW's copy of a bf16 weight


def training_state(params: int, bf16_weights: bool = False) -> dict[str, int]:
    """Bytes of weights, gradients and AdamW state (moments, and fp32 masters of bf16 weights) of
    `params` trained parameters, on one GPU: 16 bytes per parameter either way."""
    width = 2 if bf16_weights else 4
    return {
        "weights": width * params,
        "gradients": width * params,
        "optimizer": (ADAMW_MOMENTS + (FP32_MASTER if bf16_weights else 0)) * params,
    }


@dataclass(frozen=True)
class Precision:
    """What the memory of a run depends on besides its model and shape."""

    bf16_weights: bool = False  # model.param_dtype: bfloat16
    bf16_compute: bool = False  # autocast (trainer.precision amp_bf16/amp_fp16) or bf16 weights
    ema_bytes: int = 0  # per trained parameter on the GPU: 4 (fp32), 2 (bf16), 0 (none, or offloaded)
    base_weights: str | None = None  # model.base_weights: a LoRA run's frozen base stored so


def per_gpu(fp: Footprint, precision: Precision, shard: int, gpus: int, microbatch: int) -> dict[str, int]:
    """Bytes per GPU by COLUMNS, and `total`, for one copy of the model sharded over `shard` of `gpus`."""
    state = {k: -(-v // shard) for k, v in training_state(fp.trainable, precision.bf16_weights).items()}
    if shard > 1:  # FSDP gathers units whole while they compute
        state["weights"] += fp.gathered * (2 if precision.bf16_compute else 4)
    elif gpus > 1:  # DDP's buckets
        state["gradients"] *= 2
    memory = {
        **state,
        "ema": -(-fp.trainable * precision.ema_bytes // shard),
        "frozen": fp.frozen_bytes[precision.base_weights] if precision.base_weights else 4 * fp.frozen,
        "activations": fp.activations * microbatch,
    }
    return {**memory, "total": sum(memory.values())}


def add_memory_arguments(parser, gpu_count, gigabytes) -> None:
    """recipes.plan's options for the memory table (`gpu_count`, `gigabytes`: its argparse types of a
    GPU count and of a positive, finite number of GB)."""
    parser.add_argument(
        "--gpu-memory",
        type=gigabytes,
        default=DEFAULT_GPU_MEMORY,
        help="GB (10^9 bytes) per GPU; shapes needing more do not fit (default: %(default)s)",
    )
    parser.add_argument(
        "--shard", type=gpu_count, nargs="+", help="GPUs one model copy is sharded over (default: the run's)"
    )
    parser.add_argument(
        "--gpus-per-node",
        type=gpu_count,
        default=DEFAULT_GPUS_PER_NODE,
        help="a node's GPUs: `parallelism.shard: node`, and the shards suggested (default: %(default)s)",
    )


def _default(fn, name: str):
    return inspect.signature(fn).parameters[name].default


def _ema_bytes(algorithms: dict) -> int:
    from extensions.ema import EMA

    for spec in algorithms.values():
        if spec and str(spec.get("_target_", "")).rsplit(".", 1)[-1] == "EMA":
            if spec.get("offload", _default(EMA, "offload")):
                return 0
            return {"fp32": 4, "bf16": 2, "fp16": 2}.get(spec.get("storage", _default(EMA, "storage")), 4)
    return 0


def run_precision(run) -> Precision:
    bf16_weights = run.model.get("param_dtype") == "bfloat16"
    amp = str(run.trainer.get("precision") or "fp32").startswith("amp_")
    base = run.model.get("base_weights")  # a stored base computes in bf16, autocast or not
    return Precision(bf16_weights, bf16_weights or amp or base is not None, _ema_bytes(run.algorithms), base)


def fsdp1(run) -> dict | None:
    """Composer's FSDP (trainer.parallelism_config.fsdp), the older way to shard, or None."""
    return (run.trainer.get("parallelism_config") or {}).get("fsdp")


def run_shard(run, gpus: int, gpus_per_node: int) -> tuple[int, bool]:
    """(shard, weights sharded) of the run as configured at `gpus` GPUs: `parallelism.shard` (`node`:
    a node's GPUs), or with Composer's FSDP every GPU (FULL_SHARD; SHARD_GRAD_OP keeps the weights
    whole; HYBRID_SHARD a node), or 1 (DDP)."""
    shard = getattr(getattr(run, "parallelism", None), "shard", 1)
    if shard != 1:
        return (gpus_per_node if shard == "node" else int(shard)), True
    fsdp = fsdp1(run)
    if fsdp is None:
        return 1, True
    strategy = str(fsdp.get("sharding_strategy", "FULL_SHARD")).upper()
    if strategy == "NO_SHARD":
        return 1, True
    if strategy in ("HYBRID_SHARD", "_HYBRID_SHARD_ZERO2"):
        return min(gpus, gpus_per_node), True
    return gpus, strategy != "SHARD_GRAD_OP"


def run_footprint(run, shard: int) -> Footprint:
    """The run's model footprint (recipes/footprint.py) at `shard`: units are recomputed where the model
    asks for it (`gradient_checkpointing`: diffusers' own, ResNet and transformer blocks; or, sharded,
    `model.activation_checkpointing`)."""
    from models.build import build_model
    from models.training.fp8 import fp8_recipe
    from models.training.lora import check_lora_options

    options = inspect.signature(build_model).bind(**run.model)
    options.apply_defaults()
    model = options.arguments
    recomputed = None
    if model["gradient_checkpointing"]:
        recomputed = "layers"
    elif shard > 1 and (fsdp1(run) is None or fsdp1(run).get("activation_checkpointing")):
        recomputed = model["activation_checkpointing"]
    lora = model["lora"]
    if lora is not None:
        lora = check_lora_options(
            lora, model["pretrained"], model["pretrained_components"] or (), model["preset"]
        )
    try:
        return footprint(
            model["preset"],
            run.data.train.resolution,
            bf16=run_precision(run).bf16_compute,
            lora=lora,
            t5=T5_ENCODER in (model["pretrained_components"] or ()),
            fsdp_wrap=model["fsdp_wrap"],
            recomputed=recomputed,
            fp8=fp8_recipe(model["fp8"]),
        )
    except ValueError as err:  # a resolution the preset's latents cannot take (models/flops.py)
        raise ConfigError(f"data.train.resolution={run.data.train.resolution}: {err}") from err


def shape_memory(run, gpus: int, shard: int, microbatch, shard_weights: bool = True) -> dict:
    """One shape's row: shard, replicate, the microbatch counted, the COLUMNS and total in GB."""
    counted = 1 if microbatch in (None, "auto") else microbatch  # auto: Composer finds the largest that fits
    fp = run_footprint(run, shard)
    memory = per_gpu(fp, run_precision(run), shard, gpus, counted)
    if not shard_weights:  # SHARD_GRAD_OP: whole weights, sharded gradients and optimizer state
        memory = {
            **memory,
            "weights": training_state(fp.trainable, run_precision(run).bf16_weights)["weights"],
        }
        memory["total"] = sum(memory[c] for c in COLUMNS)
    return {
        "shard": shard,
        "replicate": gpus // shard,
        "microbatch": counted,
        **{k: v / 1e9 for k, v in memory.items()},
    }


def gb(value: float) -> str:
    """GB to 0.1, or to two figures below 0.05 (a tiny model's)."""
    return f"{value:.1f}" if value >= 0.05 else f"{value:.2g}"


def format_memory(rows: list[dict], gpu_memory: float) -> str:
    # A LoRA run's rows also say how its frozen base is stored (model.base_weights; null: fp32), the
    # run's own first, then what the same shape needs with each other choice (recipes/memory_advice.py).
    bases = any("base_weights" in m for row in rows for m in row["memory"])
    header = ["GPUs", "shard x replicate", "microbatch", *["base"] * bases, *COLUMNS[:3], "EMA", *COLUMNS[4:]]
    header += ["total", "fits"]
    table = [header]
    for row in rows:
        for m in row["memory"]:
            numbers = [f"{m[k]:.2f}" for k in [*COLUMNS, "total"]]
            fits = "yes" if m["fits"] else "NO"
            base = [(m.get("base_weights") or "fp32") + " (if)" * m.get("alternative", False)] * bases
            shape = [str(row["gpus"]), f"{m['shard']} x {m['replicate']}", str(m["microbatch"])]
            table.append([*shape, *base, *numbers, fits])
    widths = [max(len(line[i]) for line in table) for i in range(len(header))]
    lines = [
        f"memory per GPU in GB (10^9 bytes), against --gpu-memory {gpu_memory:g}: weights, gradients, "
        "optimizer state and EMA divide by the shard; frozen parts and activations (per microbatch) do not"
    ]
    if bases:
        lines.append(
            "base: model.base_weights, how this LoRA run stores its frozen base; (if): with that instead"
        )
    return "\n".join(lines + ["  ".join(cell.rjust(w) for cell, w in zip(line, widths)) for line in table])
