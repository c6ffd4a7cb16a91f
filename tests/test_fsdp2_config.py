"""`parallelism:` in the run config (recipes/parallelism.py): the shapes it resolves to on a launch, the
one-line errors for shapes that do not fit, the settings sharding cannot go with, and the Composer
FSDP2 config a shape becomes (its device mesh's degrees)."""

import pytest

from recipes import load_config, parse_config
from recipes.config import ConfigError
from recipes.parallelism import Parallelism, Shape, composer_parallelism, resolve
from tests.conftest import REPO

YAML = REPO / "yamls/tiny-mmdit-cpu.yaml"


@pytest.mark.parametrize(
    ("shard", "replicate", "world", "local", "want"),
    [
        (1, None, 8, 8, Shape(1, 8, fsdp2=False)),  # the default: data parallelism
        ("node", None, 16, 8, Shape(8, 2, fsdp2=True)),  # 2 nodes of 8: HSDP
        ("node", None, 8, 8, Shape(8, 1, fsdp2=True)),  # a node lost: 16 -> 8 GPUs, the same YAML
        ("node", None, 1, 1, Shape(1, 1, fsdp2=True)),  # one process: still sharded (the format)
        (2, 2, 4, 4, Shape(2, 2, fsdp2=True)),
        (4, None, 8, 8, Shape(4, 2, fsdp2=True)),  # HSDP inside a node
    ],
)
def test_shapes(shard, replicate, world, local, want):
    assert resolve(Parallelism(shard, replicate), world, local) == want


def test_a_resumed_sharded_checkpoint_keeps_data_parallel_runs_sharded():
    assert resolve(Parallelism(), 2, 2, sharded_checkpoint=True) == Shape(1, 2, fsdp2=True)


@pytest.mark.parametrize(
    ("shard", "replicate", "world", "local", "message"),
    [
        (2, 2, 8, 8, r"parallelism.shard=2 x parallelism.replicate=2 is 4 GPUs, but the run has 8 processes"),
        (3, None, 8, 8, r"parallelism.shard=3 does not divide the world size 8"),
        (16, None, 16, 8, r"parallelism.shard=16 does not divide the 8 GPUs of a node"),
        (2, None, 1, 1, r"parallelism.shard=2 does not divide the world size 1"),
    ],
)
def test_shapes_that_do_not_fit_are_one_line_errors(shard, replicate, world, local, message):
    with pytest.raises(ValueError, match=message) as error:
        resolve(Parallelism(shard, replicate), world, local)
    assert "\n" not in str(error.value)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("parallelism.shard=half", r"'?parallelism.shard must be a positive number of GPUs or 'node'"),
        ("parallelism.shard=0", r"parallelism.shard must be a positive number"),
        ("parallelism.replicate=0", r"parallelism.replicate must be a positive number of model copies"),
        ("parallelism.mixed_precision=fp8", r"parallelism.mixed_precision must be one of"),
        ("parallelism.shards=2", r"unknown config key 'parallelism.shards'; did you mean 'shard'"),
        (
            "+trainer.parallelism_config={fsdp: {sharding_strategy: FULL_SHARD}}",
            r"parallelism.shard=2 shards with FSDP2 and trainer.parallelism_config.fsdp asks for .*FSDP1",
        ),
        ("trainer.device_train_microbatch_size=auto", r"microbatch_size=auto, which Composer's FSDP2"),
        ("model.param_dtype=bfloat16", r"model.param_dtype=bfloat16: FSDP2 keeps fp32 sharded weights"),
    ],
)
def test_config_mistakes_name_the_key(override, message):
    overrides = ["model.pretrained=null", override]
    if not override.startswith("parallelism.sh"):
        overrides.append("parallelism.shard=2")
    with pytest.raises(ConfigError, match=message):
        parse_config(load_config(YAML, overrides))


def test_the_composer_config_of_a_shape():
    """Composer's FSDP2Config with the mesh degrees Composer builds its device mesh from (its
    `_create_device_mesh` reads them), sharded checkpoints, and activation checkpointing when the model
    names blocks to recompute."""
    from composer.utils import FSDP2Config

    p = Parallelism(shard=2, replicate=2, mixed_precision="pure")
    config = composer_parallelism(Shape(2, 2, fsdp2=True), p, activation_checkpointing=True).fsdp2
    assert isinstance(config, FSDP2Config)
    assert (config.data_parallel_replicate_degree, config.data_parallel_shard_degree) == (2, 2)
    assert config.state_dict_type == "sharded" and config.mixed_precision == "PURE"
    assert config.activation_checkpointing
    one_copy = composer_parallelism(Shape(4, 1, fsdp2=True), Parallelism(shard=4), False).fsdp2
    assert (one_copy.data_parallel_replicate_degree, one_copy.data_parallel_shard_degree) == (None, 4)
    assert not one_copy.activation_checkpointing
    assert composer_parallelism(Shape(1, 8, fsdp2=False), Parallelism(), False) is None


def test_the_recipes_shard_sd3_medium_and_not_sd2_base():
    given = {"data.train.remote": "s3://b/d", "model.pretrained": "/m", "trainer.save_folder": "/c"}
    sd3 = parse_config(load_config(REPO / "yamls/sd3-medium.yaml", [f"{k}={v}" for k, v in given.items()]))
    assert sd3.parallelism.shard == "node" and "parallelism_config" not in sd3.trainer
    sd2 = parse_config(load_config(REPO / "yamls/sd2-base.yaml", [f"{k}={v}" for k, v in given.items()]))
    assert sd2.parallelism == Parallelism()
