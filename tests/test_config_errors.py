"""Config mistakes fail in build_trainer before any model, dataloader or Trainer is built, with a
ConfigError naming the key (and train.py turns it into a one-line `config error:` exit)."""

import pytest
import torch
from composer.utils import dist

from recipes import ConfigError, build_trainer, load_config
from tests.conftest import REPO

TINY = REPO / "yamls" / "tiny-cpu.yaml"


def _fails(overrides, shapes_mds, match):
    base = [f"data.train.local={shapes_mds / 'mds'}", "~data.train.prepare", "model.pretrained=null"]
    with pytest.raises(ConfigError, match=match):
        build_trainer(load_config(TINY, base + overrides))


@pytest.mark.parametrize(
    "overrides, match",
    [
        (["no_such_key=1"], "unknown config key 'no_such_key'"),
        (["trainer.max_durations=2ba"], "'trainer.max_durations'; did you mean 'max_duration'"),
        (["data.train.resolutoin=64"], "'data.train.resolutoin'; did you mean 'resolution'"),
        (["trainer.save_folder=???"], "'trainer.save_folder' must be set"),  # a recipe's `???`
        (["run_name=null"], "'run_name' must be set \\(it is empty\\)"),
        (["~global_train_batch_size"], "'global_train_batch_size' is missing"),
        (
            ["global_train_batch_size=16", "trainer.device_train_microbatch_size=32"],
            "trainer.device_train_microbatch_size=32 is larger than the per-device batch 16",
        ),
        (
            ["global_train_batch_size=16", "trainer.device_train_microbatch_size=6"],
            "trainer.device_train_microbatch_size=6 does not divide the per-device batch 16",
        ),
        (["trainer.precision=amp_bf16"], "'trainer.precision' is amp_bf16, which the CPU cannot run"),
        (["trainer.precision=amp_fp16"], "'trainer.precision' is amp_fp16, which the CPU cannot run"),
        (
            ["optimizer.weight_decy=0.1"],
            "unknown config key 'optimizer.weight_decy'; did you mean 'weight_decay'",
        ),
        (
            ["callbacks.nan_guard.check_inff=false"],
            "'callbacks.nan_guard.check_inff'; did you mean 'check_inf'",
        ),
        (
            ["algorithms.ema.half_lfe=3"],
            "unknown config key 'algorithms.ema.half_lfe'; did you mean 'half_life'",
        ),
        (
            ["~scheduler.t_warmup"],
            r"'scheduler' \(composer.optim.CosineAnnealingWithWarmupScheduler\) needs 't_warmup'",
        ),
        (
            ["callbacks.speed_monitor._target_=composer.callbacks.SpeedMonitr"],
            "'callbacks.speed_monitor._target_': cannot import 'composer.callbacks.SpeedMonitr'",
        ),
        (
            ["+trainer.device_train_microbatch_size=auto"],
            "'trainer.device_train_microbatch_size' is auto, which needs a CUDA GPU",
        ),
        (
            ["+trainer.parallelism_config={fsdp: {sharding_strategy: SHARD_GRAD_OP}}"],
            "'trainer.parallelism_config.fsdp' needs CUDA GPUs",
        ),
    ],
)
def test_config_mistake_is_named_before_anything_is_built(overrides, match, shapes_mds, nothing_built):
    _fails(overrides, shapes_mds, match)


def test_global_batch_not_divisible_by_world_size(shapes_mds, nothing_built, monkeypatch):
    monkeypatch.setattr(dist, "get_world_size", lambda: 3)  # as under `composer -n 3`
    _fails(
        ["global_train_batch_size=16"],
        shapes_mds,
        "global_train_batch_size=16 is not divisible by the world size 3",
    )


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine can run trainer.device=gpu")
def test_gpu_device_without_a_gpu(shapes_mds, nothing_built):
    _fails(["trainer.device=gpu"], shapes_mds, "'trainer.device' is gpu but this machine has no CUDA GPU")


def test_missing_data_paths_are_named(shapes_mds, tmp_path, nothing_built):
    _fails(
        [f"data.train.local={tmp_path / 'nope'}"],
        shapes_mds,
        f"data.train: data.local={tmp_path / 'nope'} holds no",
    )
    _fails(["data.train.local=null"], shapes_mds, "data.train: data: set `local`")
    _fails(
        [f"+data.eval={{local: {tmp_path / 'gone'}}}"],
        shapes_mds,
        f"data.eval: data.local={tmp_path / 'gone'}",
    )
    _fails(["data.train.prepare=nosuch"], shapes_mds, "data.train: data.prepare='nosuch' is not one of")
