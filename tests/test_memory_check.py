"""The memory check before the model is built (recipes/memory_check.py, issue 47): flux-dev on a
24 GB host is one config-error line naming the planner's estimate, the memory there and a change
that would fit, before anything is built (it used to grow until the out-of-memory killer ended it);
the same on a GPU's free memory; the tiny recipes never pay for the estimate; SD_MEMORY_CHECK=off
skips it."""

import pytest
import torch

from recipes import ConfigError, load_config, parse_config
from recipes.memory_check import check_memory, host_available
from recipes.scaling import plan_batches
from tests.conftest import REPO

TINY = REPO / "yamls" / "tiny-cpu.yaml"
OVERRIDES = [
    "callbacks.samples=null",
    "~data.train.prepare",
    "trainer.max_duration=2ba",
]


@pytest.fixture(scope="module")
def flux_dev(tmp_path_factory) -> list[str]:
    """flux-dev's overrides: a folder with FLUX.1's T5 tokenizer (the offline tiny one), which is all
    of FLUX.1 a run must load (its tokenizer is not built offline); the networks are built."""
    from models.engine.tokenizer import build_t5_tokenizer

    folder = tmp_path_factory.mktemp("flux-dev")
    build_t5_tokenizer().save_pretrained(folder / "tokenizer_2")
    return [
        "model.preset=flux-dev",
        f"model.pretrained={folder}",
        "model.pretrained_components=[tokenizer_2]",
    ]


def _run(shapes_mds, *extra):
    own = [] if any(e.startswith("model.pretrained=") for e in extra) else ["model.pretrained=null"]
    return parse_config(
        load_config(TINY, [*OVERRIDES, *own, f"data.train.local={shapes_mds / 'mds'}", *extra])
    )


def _plan(run, world=1):
    return plan_batches(run.global_train_batch_size, world, run.trainer.get("device_train_microbatch_size"))


@pytest.mark.heavy
def test_flux_dev_on_a_24_gb_host_is_one_line_before_anything_is_built(
    shapes_mds, flux_dev, monkeypatch, nothing_built
):
    import recipes.memory_check
    import train as train_py

    monkeypatch.setattr(recipes.memory_check, "host_available", lambda: 24 * 10**9)
    argv = [str(TINY), *OVERRIDES, f"data.train.local={shapes_mds / 'mds'}", *flux_dev]
    with pytest.raises(SystemExit) as exit_:
        train_py.main(argv)
    message = str(exit_.value.code)
    assert message.startswith("config error: model.preset=flux-dev needs about "), message
    assert "this host has 24.0 GB of memory available" in message and "python -m recipes.plan" in message
    assert "SD_MEMORY_CHECK=off skips this check" in message and "\n" not in message
    assert "GPU" not in message, message  # a CPU run: processes and a host, not GPUs
    total = float(message.split("needs about ")[1].split(" GB")[0])
    assert total > 150  # 11.9e9 trained parameters at 16 bytes each, before the rest
    assert not nothing_built


@pytest.mark.heavy
def test_on_a_gpu_the_free_memory_is_what_counts_and_the_advice_names_what_fits(
    shapes_mds, flux_dev, monkeypatch
):
    """flux-dev on 8 processes of a node of 80 GB GPUs, unsharded: refused, and the planner's advice
    names the changes that fit (sharding over the node, with a smaller microbatch or recomputing)."""
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda index: (80 * 10**9, 85 * 10**9))
    run = _run(shapes_mds, *flux_dev, "trainer.device=gpu")
    with pytest.raises(ConfigError) as error:
        check_memory(run, 8, 1, _plan(run, 8))
    message = str(error.value)
    assert "and GPU 0 (NVIDIA H100 80GB HBM3) has 80.0 of 85.0 GB free: " in message
    assert "it fits with parallelism.shard=8 " in message and "\n" not in message
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda index: (10**12, 10**12))
    check_memory(run, 8, 1, _plan(run, 8))  # a GPU with room: no error


def test_the_tiny_recipe_never_traces_a_step_and_the_check_can_be_turned_off(shapes_mds, monkeypatch):
    import recipes.memory

    def traced(*args, **kwargs):
        raise AssertionError("the full estimate was made for a model far below the memory")

    monkeypatch.setattr(recipes.memory, "shape_memory", traced)
    run = _run(shapes_mds)
    check_memory(run, 1, 1, _plan(run))
    monkeypatch.setattr("recipes.memory_check.host_available", lambda: 10**6)  # 1 MB: the floor is above it
    with pytest.raises(AssertionError, match="full estimate"):
        check_memory(run, 1, 1, _plan(run))
    monkeypatch.setenv("SD_MEMORY_CHECK", "off")
    check_memory(run, 1, 1, _plan(run))


def test_the_host_s_available_memory_is_read():
    assert 10**8 < host_available() < 10**14
