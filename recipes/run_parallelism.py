"""A run's parallelism on this launch (recipes/parallelism.py says what the keys mean): its shape, a
config error when it does not fit, and composer.Trainer's `parallelism_config`, which a resumed
sharded checkpoint also asks for. build_trainer calls these once the world size is known.
"""

import logging

from composer.utils import dist

from recipes.config import ConfigError
from recipes.file_to_sharded import sharded_copy
from recipes.parallelism import Shape, composer_parallelism, resolve, shards
from recipes.resume import loads_sharded

log = logging.getLogger(__name__)


def shape_of(run, world_size: int, sharded_checkpoint: bool = False) -> Shape:
    """`resolve` for a parsed run config on this launch (its local world size), mistakes as ConfigError."""
    try:
        return resolve(run.parallelism, world_size, dist.get_local_world_size(), sharded_checkpoint)
    except ValueError as err:
        raise ConfigError(str(err)) from err


def with_parallelism(kwargs: dict, run, world_size: int) -> dict:
    """composer.Trainer's keyword arguments `kwargs` (their load_path decided: recipes/resume.py) with
    the `parallelism_config` of `run`'s shape on this launch; unchanged for data parallelism, or when
    the run gives Composer's FSDP1 config itself (trainer.parallelism_config)."""
    if kwargs.get("parallelism_config") is not None:
        return kwargs
    sharded_checkpoint = loads_sharded(kwargs.get("load_path"))
    shape = shape_of(run, world_size, sharded_checkpoint)
    config = composer_parallelism(shape, run.parallelism, bool(run.model.get("activation_checkpointing")))
    if config is None:
        return kwargs
    # The Trainer builds the device mesh from the process group: one, also for a single process.
    dist.initialize_dist(run.trainer.get("device"), run.trainer.get("dist_timeout", 300.0))
    if kwargs.get("load_path") and not sharded_checkpoint:  # a one-file checkpoint, continued sharded
        kwargs = {**kwargs, "load_path": sharded_copy(kwargs["load_path"])}
    why = " (parallelism.shard=1: it resumes a sharded checkpoint)" if not shards(run.parallelism) else ""
    log.info(
        "parallelism: FSDP2, the denoiser sharded over %d %s x %d cop%s%s; sharded checkpoints",
        shape.shard,
        "CPU process(es)" if run.trainer.get("device") == "cpu" else "GPU(s)",
        shape.replicate,
        "y" if shape.replicate == 1 else "ies (HSDP)",
        why,
    )
    return {**kwargs, "parallelism_config": config}
