"""Every recipe in yamls/ composes, validates and (shrunk to the tiny preset) trains."""

import pytest
from composer.callbacks import LRMonitor, SpeedMonitor
from omegaconf import OmegaConf

from recipes import ConfigError, build_trainer, load_config, parse_config
from recipes.callbacks import NaNGuard
from tests.conftest import REPO

YAMLS = REPO / "yamls"
REQUIRED = {
    "sd2-base": [
        "data.train.remote=s3://bucket/mds",
        "model.pretrained=/models/sd2",
        "trainer.save_folder=/ckpt",
    ],
    "sd2-base-512": [
        "data.train.remote=s3://bucket/mds",
        "model.pretrained=/models/sd2",
        "trainer.save_folder=/ckpt512",
        "trainer.load_path=/ckpt/latest-rank0.pt",
    ],
    "sd2-finetune": ["data.train.local=/data/mds", "model.pretrained=/models/sd2", "trainer.save_folder=/ft"],
    "tiny-cpu": [],
    "tiny-vae": [],
}


@pytest.mark.parametrize("name", sorted(REQUIRED))
def test_recipe_composes_and_validates(name):
    assert sorted(p.stem for p in YAMLS.glob("*.yaml") if not p.stem.startswith("_")) == sorted(REQUIRED)
    run = parse_config(load_config(YAMLS / f"{name}.yaml", REQUIRED[name]))
    assert run.run_name and run.global_train_batch_size > 0
    if REQUIRED[name]:  # leaving out what only the user knows is an error naming every such key
        with pytest.raises(ConfigError, match="must be set") as err:
            parse_config(load_config(YAMLS / f"{name}.yaml"))
        for override in REQUIRED[name]:
            assert f"'{override.split('=')[0]}'" in str(err.value)


def _flat(name: str) -> dict:
    cfg = OmegaConf.to_container(load_config(YAMLS / f"{name}.yaml", REQUIRED["sd2-base"]))

    def walk(node, prefix=""):
        if isinstance(node, dict):
            for key, value in node.items():
                yield from walk(value, f"{prefix}{key}.")
        else:
            yield prefix[:-1], node

    return dict(walk(cfg))


def test_stage_two_differs_from_stage_one_only_where_intended():
    base, stage2 = _flat("sd2-base"), _flat("sd2-base-512")
    changed = {k for k in base.keys() | stage2.keys() if base.get(k) != stage2.get(k)}
    assert changed == {
        "run_name",
        "data.train.resolution",
        "trainer.max_duration",
        "trainer.load_path",
        "trainer.load_weights_only",
        "algorithms.ema._target_",
        "algorithms.ema.smoothing",
        "algorithms.ema.ema_start",
    }
    assert (stage2["data.train.resolution"], stage2["trainer.max_duration"]) == (512, "850000ba")
    assert stage2["algorithms.ema.ema_start"] == "800000ba" and stage2["trainer.load_weights_only"] is True
    assert base["global_train_batch_size"] == 2048 and base["trainer.max_duration"] == "550000ba"
    assert base["trainer.parallelism_config.fsdp.sharding_strategy"] == "SHARD_GRAD_OP"


def test_sd2_base_wiring_trains_on_the_tiny_preset(shapes_mds, tmp_path):
    """The sd2-base recipe with only what a CPU cannot run swapped out: same callbacks, optimizer,
    scheduler, batch split and autoresume, on the tiny preset and synthetic data."""
    overrides = [
        "model.preset=tiny",
        "model.pretrained=null",
        "model.low_precision_norms=null",
        "data.train.remote=null",
        f"data.train.local={shapes_mds / 'mds'}",
        "data.train.num_workers=0",
        "global_train_batch_size=8",
        "trainer.device_train_microbatch_size=4",
        "trainer.device=cpu",
        "trainer.precision=fp32",
        "trainer.parallelism_config=null",
        "trainer.max_duration=2ba",
        f"trainer.save_folder={tmp_path}",
        "trainer.progress_bar=false",
        "~loggers.wandb",
        "callbacks.memory_monitor=null",
    ]
    trainer = build_trainer(load_config(YAMLS / "sd2-base.yaml", overrides))
    callbacks = {type(c) for c in trainer.state.callbacks}
    assert {SpeedMonitor, LRMonitor, NaNGuard} <= callbacks
    optimizer = trainer.state.optimizers[0]
    assert type(optimizer).__name__ == "AdamW"
    assert optimizer.defaults["lr"] == 1e-4 and optimizer.defaults["weight_decay"] == 0.01
    assert trainer.state.device_train_microbatch_size == 4
    assert trainer.state.model.caption_drop_prob == 0.1
    trainer.fit()
    assert int(trainer.state.timestamp.batch) == 2
    assert sorted(p.name for p in tmp_path.glob("ep*.pt")) == ["ep0-ba2-rank0.pt"]
