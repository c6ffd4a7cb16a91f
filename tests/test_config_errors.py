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
            ["trainer.device_train_microbatch_size=0"],
            "trainer.device_train_microbatch_size must be a positive integer or 'auto', got 0",
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
        # Values, not only names: what the constructors (or Composer, once built) would refuse.
        (
            ["callbacks.samples.sampler=foo"],
            r"^callbacks.samples.sampler='foo' is not one of \['ddim', 'dpm\+\+', 'euler'\]$",
        ),
        (["callbacks.samples.steps=0"], r"^callbacks.samples.steps=0 must be a positive integer$"),
        (
            ["callbacks.samples.interval=banana"],
            r"^'callbacks.samples' \(extensions.sample_grids.SampleGrids\): Invalid time string: banana$",
        ),
        (
            ["algorithms.ema.storage=fp8"],
            r"^'algorithms.ema' \(extensions.ema.EMA\): EMA storage='fp8'; choose one of",
        ),
        (["optimizer.lr=fast"], r"^'optimizer.lr' must be a number, got 'fast'$"),
        (["optimizer.lr=-1"], r"^'optimizer' \(torch.optim.AdamW\): Invalid learning rate: -1$"),
        (["scheduler.t_warmup=soon"], r"^'scheduler' \(.*CosineAnnealingWithWarmupScheduler\): Invalid time"),
        (
            ["trainer.max_duration=banana"],
            r"^'trainer.max_duration' must be a duration, e.g. 550000ba .*'banana'$",
        ),
        (["trainer.max_duration=0ba"], r"^'trainer.max_duration' must be more than zero, .*got '0ba'$"),
        (["trainer.max_duration=0"], r"^'trainer.max_duration' must be more than zero, .*got 0$"),
        (["trainer.max_duration=1dur"], r"^'trainer.max_duration' cannot be in dur"),
        (
            ["+trainer.device_train_microbatch_size=auto"],
            "'trainer.device_train_microbatch_size' is auto, which needs a CUDA GPU",
        ),
        (
            ["+trainer.parallelism_config={fsdp: {sharding_strategy: SHARD_GRAD_OP}}"],
            "'trainer.parallelism_config.fsdp' needs CUDA GPUs",
        ),
        (
            ["+trainer.parallelism_config={fsdp: {activation_checkpointing: true}}"],
            "needs activation_checkpointing_reentrant: false",
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


@pytest.mark.heavy
def test_missing_data_paths_are_named(shapes_mds, tmp_path, nothing_built):
    # The whole key, as written on the command line (data.train.local, not data.local).
    nope, gone = tmp_path / "nope", tmp_path / "gone"
    _fails([f"data.train.local={nope}"], shapes_mds, f"^data.train.local={nope} does not exist")
    _fails(["data.train.local=null"], shapes_mds, "^data.train: set `local`")
    _fails([f"+data.eval={{local: {gone}}}"], shapes_mds, f"^data.eval.local={gone} does not exist")
    _fails(["data.train.prepare=nosuch"], shapes_mds, "^data.train.prepare='nosuch' is not one of")


def test_cli_value_mistakes_are_one_config_error_line(shapes_mds, nothing_built, capsys):
    """Through train.py's own main, as a user runs it: one line, no traceback."""
    import train as train_py

    base = [f"data.train.local={shapes_mds / 'mds'}", "~data.train.prepare", "model.pretrained=null"]
    for override, expected in [
        ("callbacks.samples.sampler=foo", "config error: callbacks.samples.sampler='foo' is not one of"),
        ("optimizer.lr=fast", "config error: 'optimizer.lr' must be a number, got 'fast'"),
        ("trainer.max_duration=0ba", "config error: 'trainer.max_duration' must be more than zero"),
    ]:
        with pytest.raises(SystemExit) as exit_:
            train_py.main([str(TINY), *base, override])
        assert str(exit_.value.code).startswith(expected)
        assert "\n" not in str(exit_.value.code)
