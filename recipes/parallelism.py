"""`parallelism:` in the run config: how many GPUs one copy of the model is sharded over (`shard`) and
how many copies train side by side (`replicate`), and what that becomes for Composer.

    parallelism:
      shard: node      # an int, or `node`: the GPUs of one node (the local world size)
      replicate: null  # copies of the sharded model; null: world size / shard

- `shard: 1` (the default) is data parallelism: DDP on several processes, no wrapper on one.
- `shard` other than 1 shards the denoiser with torch's FSDP2 (`fully_shard`, through Composer 0.32.1's
  `FSDP2Config`): one unit per block (`model.fsdp_wrap`, models/training/sharding.py), the blocks of
  `model.activation_checkpointing` recomputed in the backward pass, and sharded checkpoints (torch
  distributed checkpoint: a folder per checkpoint, one file per rank of the first copy and a
  `.metadata` written last). `replicate` > 1 is HSDP: a 2-D mesh (replicate x shard); gradients are
  reduce-scattered within a copy and all-reduced across copies.
- A run that resumes a sharded checkpoint stays sharded whatever its `shard` (recipes/resume.py):
  `shard: 1` then shards over one GPU per copy (an FSDP2 mesh of replicate x 1), so the checkpoint
  loads on any number of GPUs (torch distributed checkpoint reshards on load).

`shard x replicate` must be the world size and `shard` must divide the GPUs of a node (a copy's
all-gathers, one per block and step, stay on the node's fast links); both are config errors naming
the numbers, checked once the world size is known (`resolve`, before anything is built).
`trainer.parallelism_config` (Composer's FSDP1, GPU only, kept for sd2-base's per-block ZeRO-2
variant that `make gpu-check` times) cannot be combined with a `shard` other than 1.
"""

from dataclasses import dataclass

NODE = "node"
# Composer's FSDP2 mixed-precision names: DEFAULT (compute in trainer.precision's dtype, fp32
# reductions and fp32 sharded master weights), PURE (reductions in that dtype too), FULL (fp32).
MIXED_PRECISION = ("DEFAULT", "PURE", "FULL")


@dataclass
class Parallelism:
    shard: int | str = 1  # GPUs one copy of the model is sharded over; `node`: the GPUs of a node
    replicate: int | None = None  # copies of the model; None: world size / shard
    mixed_precision: str = "DEFAULT"  # under sharding: fp32 reductions and master weights
    # Free each block's gathered weights after its forward (ZeRO-3) or keep them for the backward
    # (false: ZeRO-2, one all-gather fewer per block and step, a block's whole weights held meanwhile).
    reshard_after_forward: bool = True

    def __post_init__(self):
        problem = static_problem(self)
        if problem is not None:
            raise ValueError(problem)


def static_problem(p: Parallelism) -> str | None:
    """What is wrong with `parallelism:` whatever the world size; None when nothing is."""
    if p.shard != NODE and (isinstance(p.shard, bool) or not isinstance(p.shard, int) or p.shard < 1):
        return f"shard must be a positive number of GPUs or '{NODE}' (the GPUs of a node), got {p.shard!r}"
    if p.replicate is not None and (isinstance(p.replicate, bool) or p.replicate < 1):
        return f"replicate must be a positive number of model copies or null, got {p.replicate!r}"
    if str(p.mixed_precision).upper() not in MIXED_PRECISION:
        return f"mixed_precision must be one of {list(MIXED_PRECISION)}, got {p.mixed_precision!r}"
    return None


def shards(p: Parallelism) -> bool:
    """Whether the config asks for sharding (FSDP2): any `shard` but 1."""
    return p.shard != 1


@dataclass(frozen=True)
class Shape:
    shard: int
    replicate: int
    fsdp2: bool  # sharded with FSDP2 (also when shard is 1: a resumed sharded run on one GPU per copy)


def resolve(
    p: Parallelism, world_size: int, local_world_size: int, sharded_checkpoint: bool = False
) -> Shape:
    """The shape `p` gives on `world_size` processes, `local_world_size` per node; ValueError (one line
    naming the numbers) for a shape that does not fit. `sharded_checkpoint`: the run resumes a sharded
    checkpoint, which only FSDP2 loads."""
    shard = local_world_size if p.shard == NODE else p.shard
    where = f"parallelism.shard={p.shard}" + (f" ({shard} GPUs)" if p.shard == NODE else "")
    if p.replicate is None and world_size % shard:
        raise ValueError(
            f"{where} does not divide the world size {world_size}; shard x replicate must be the "
            "number of processes"
        )
    replicate = world_size // shard if p.replicate is None else p.replicate
    if shard * replicate != world_size:
        raise ValueError(
            f"{where} x parallelism.replicate={replicate} is {shard * replicate} GPUs, but the run has "
            f"{world_size} process{'es' if world_size > 1 else ''}; shard x replicate must be the world size"
        )
    if local_world_size % shard:
        raise ValueError(
            f"{where} does not divide the {local_world_size} GPUs of a node: a copy's shards must lie "
            "within one node (they all-gather every block, every step); use a divisor of "
            f"{local_world_size} or shard=node"
        )
    return Shape(shard, replicate, fsdp2=shards(p) or sharded_checkpoint)


def composer_parallelism(shape: Shape, p: Parallelism, activation_checkpointing: bool):
    """composer.Trainer's `parallelism_config` for `shape`, or None for data parallelism."""
    if not shape.fsdp2:
        return None
    from composer.utils.parallelism import ParallelismConfig

    from compat.composer import mesh_fsdp2_config

    config = mesh_fsdp2_config(
        shard=shape.shard,
        replicate=shape.replicate if shape.replicate > 1 else None,
        state_dict_type="sharded",
        mixed_precision=str(p.mixed_precision).upper(),
        reshard_after_forward=p.reshard_after_forward,
        activation_checkpointing=activation_checkpointing,
    )
    return ParallelismConfig(fsdp2=config)


def config_problem(p: Parallelism, model: dict, trainer: dict) -> str | None:
    """What cannot go with sharding (a `shard` other than 1) in the rest of the config; None if nothing."""
    if not shards(p):
        return None
    where = f"parallelism.shard={p.shard}"
    if (trainer.get("parallelism_config") or {}).get("fsdp") is not None:
        return (
            f"{where} shards with FSDP2 and trainer.parallelism_config.fsdp asks for Composer's FSDP1: "
            "keep one (remove it with ~trainer.parallelism_config, or set parallelism.shard=1)"
        )
    if model.get("param_dtype") not in (None, "float32"):
        return (
            f"{where} with model.param_dtype={model['param_dtype']}: FSDP2 keeps fp32 sharded weights "
            "and casts them for compute itself (parallelism.mixed_precision); leave model.param_dtype unset"
        )
    if model.get("base_weights") is not None:  # torchao's stored tensors under FSDP2: not tried here
        return (
            f"{where} with model.base_weights={model['base_weights']}: a stored base is held whole on "
            "each device, not sharded: set parallelism.shard=1"
        )
    from models.training.torch_compile import compiles_with_cudagraphs

    if compiles_with_cudagraphs(model.get("compile_unet")):
        return (
            f"{where} with model.compile_unet={model['compile_unet']}, which replays CUDA graphs: FSDP2 "
            "gathers its weights into new memory every step; use compile_unet: true or no sharding"
        )
    if trainer.get("device_train_microbatch_size") == "auto":
        return (
            f"{where} with trainer.device_train_microbatch_size=auto, which Composer's FSDP2 does not "
            "support; give a number"
        )
    return None
