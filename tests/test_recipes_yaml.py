"""Every recipe in yamls/ composes, validates and (shrunk to the tiny preset) trains."""

import shutil

import pytest
import torch
import yaml
from composer.algorithms.low_precision_groupnorm.low_precision_groupnorm import LPGroupNorm
from composer.algorithms.low_precision_layernorm.low_precision_layernorm import LPLayerNorm
from composer.callbacks import LRMonitor, MemoryMonitor, SpeedMonitor
from composer.loggers import WandBLogger
from composer.optim import LinearWithWarmupScheduler
from omegaconf import OmegaConf

from data.image_caption import ImageCaptionDataset
from models import build_model
from models.record import ModelRecord, describe
from recipes import ConfigError, build_trainer, load_config, parse_config
from recipes.callbacks import NaNGuard
from recipes.samples import SampleGrids
from recipes.trainer import trainer_kwargs
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
    "sd2-lora": ["data.train.local=/data/mds", "model.pretrained=/models/sd2", "trainer.save_folder=/lora"],
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
        "trainer.device_train_microbatch_size",
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
    """The sd2-base recipe as it would run on 8 GPUs, only the preset shrunk to tiny: the objects and
    settings handed to composer.Trainer; then, with what a CPU cannot run swapped out, two batches."""
    source = build_model("tiny")  # the "pretrained" SD2 folder: its VAE, text encoder and tokenizer
    for name in ("vae", "text_encoder", "tokenizer"):
        getattr(source, name).save_pretrained(tmp_path / "sd2" / name)
    for cache in ("cache", "cpu-cache"):  # the remote's local cache, already filled: nothing downloads
        shutil.copytree(shapes_mds / "mds", tmp_path / cache)
    given = [  # what only the user knows (the YAML's ???), and the tiny preset
        "model.preset=tiny",
        f"model.pretrained={tmp_path / 'sd2'}",
        "data.train.remote=s3://bucket/laion-mds",
        f"data.train.local={tmp_path / 'cache'}",
        "trainer.save_folder=s3://bucket/checkpoints/sd2-base-256",
    ]
    run = parse_config(load_config(YAMLS / "sd2-base.yaml", given))
    if not torch.cuda.is_available():  # refused before anything is built
        with pytest.raises(ConfigError, match="'trainer.device' is gpu"):
            build_trainer(run)

    kwargs = trainer_kwargs(run, world_size=8)
    # trainer: every key of the YAMLs (read here without Hydra) passes through unchanged.
    base, sd2 = (yaml.safe_load((YAMLS / f"{n}.yaml").read_text()) for n in ("_base", "sd2-base"))
    expected = {**base["trainer"], **sd2["trainer"], "save_folder": "s3://bucket/checkpoints/sd2-base-256"}
    recipe_keys = {"run_name", "seed", "model", "train_dataloader", "eval_dataloader", "optimizers"}
    recipe_keys |= {"schedulers", "algorithms", "callbacks", "loggers"}
    assert kwargs.keys() == recipe_keys | expected.keys()
    assert {k: kwargs[k] for k in expected} == expected
    assert (kwargs["precision"], kwargs["device"], kwargs["autoresume"]) == ("amp_bf16", "gpu", True)
    assert kwargs["parallelism_config"] == {
        "fsdp": {"sharding_strategy": "SHARD_GRAD_OP", "mixed_precision": "PURE", "state_dict_type": "full"}
    }
    assert (kwargs["max_duration"], kwargs["save_interval"]) == ("550000ba", "10000ba")
    assert (kwargs["run_name"], kwargs["seed"]) == ("sd2-base-256", 17)
    # Batch split on 8 devices: 2048 / 8 = 256 images per device, microbatches of 32, 8 accumulation steps.
    loader = kwargs["train_dataloader"]
    assert loader.batch_size == loader.dataset.batch_size == 256
    assert kwargs["device_train_microbatch_size"] == 32
    assert loader.num_workers == 8 and loader.drop_last and kwargs["eval_dataloader"] is None
    dataset = loader.dataset
    assert isinstance(dataset, ImageCaptionDataset) and not dataset.hflip and dataset.shuffle
    [stream] = dataset.streams
    assert (stream.remote, stream.local) == ("s3://bucket/laion-mds", str(tmp_path / "cache"))
    assert dataset.num_canonical_nodes == 8
    assert dataset[0]["image"].shape == (3, 256, 256)  # resolution 256, read from the filled cache
    # Model: LP norms on the UNet, caption dropout, the frozen parts from the pretrained folder.
    model = kwargs["model"]
    assert model.caption_drop_prob == 0.1 and model.prediction_type == "epsilon"
    assert any(isinstance(m, LPGroupNorm) for m in model.unet.modules())
    assert any(isinstance(m, LPLayerNorm) for m in model.unet.modules())
    for name in ("vae", "text_encoder"):
        mine, theirs = getattr(model, name).state_dict(), getattr(source, name).state_dict()
        assert all(mine[k].equal(v) for k, v in theirs.items())
    # Optimizer on the UNet alone, with SD2's hyperparameters; linear warmup over 10k batches.
    optimizer = kwargs["optimizers"]
    assert type(optimizer).__name__ == "AdamW"
    optimized = {id(p) for group in optimizer.param_groups for p in group["params"]}
    assert optimized == {id(p) for p in model.unet.parameters()}
    hyper = {k: optimizer.defaults[k] for k in ("lr", "weight_decay", "betas", "eps", "fused")}
    assert hyper == {"lr": 1e-4, "weight_decay": 0.01, "betas": [0.9, 0.999], "eps": 1e-8, "fused": True}
    scheduler = kwargs["schedulers"]
    assert isinstance(scheduler, LinearWithWarmupScheduler)
    assert (str(scheduler.t_warmup), scheduler.alpha_f) == ("10000ba", 1.0)
    # Gradient clipping only: EMA comes with stage 2 (sd2-base-512.yaml).
    assert [(type(a).__name__, a.clipping_type, a.clipping_threshold) for a in kwargs["algorithms"]] == [
        ("GradientClipping", "norm", 1.0)
    ]
    callbacks = kwargs["callbacks"]
    expected = [SpeedMonitor, LRMonitor, MemoryMonitor, NaNGuard, SampleGrids, ModelRecord]
    assert [type(c) for c in callbacks] == expected
    assert callbacks[5].state_dict()["unet"] == describe(kwargs["model"])["unet"]  # in every checkpoint
    grids = callbacks[4]
    assert (len(grids.prompts), grids.per_prompt, grids.guidance, grids.steps) == (4, 4, [3.0, 7.5], 25)
    assert callbacks[0].history_samples.maxlen == 10 + 1  # window_size 10
    assert callbacks[3].check_inf and callbacks[3].save_last_good
    [logger] = kwargs["loggers"]
    assert isinstance(logger, WandBLogger) and logger.project == "sd2-base"

    # Two batches on the CPU: the same recipe but for the device, precision, FSDP, wandb and the
    # GPU memory monitor, with 32 px images and a batch the 64-image set holds.
    cpu = [
        f"data.train.local={tmp_path / 'cpu-cache'}",
        "data.train.resolution=32",
        "data.train.num_workers=0",
        "global_train_batch_size=8",
        "trainer.device_train_microbatch_size=4",
        "trainer.device=cpu",
        "trainer.precision=fp32",
        "~trainer.parallelism_config",
        "trainer.max_duration=2ba",
        f"trainer.save_folder={tmp_path / 'checkpoints'}",
        "trainer.progress_bar=false",
        "~loggers.wandb",
        "callbacks.memory_monitor=null",
        "callbacks.samples.per_prompt=1",
        "callbacks.samples.steps=2",
    ]
    trainer = build_trainer(load_config(YAMLS / "sd2-base.yaml", given + cpu))
    assert trainer.state.device_train_microbatch_size == 4
    trainer.fit()
    assert int(trainer.state.timestamp.batch) == 2
    # The linear warmup is in force: Composer steps the schedule before it counts the batch, so after
    # two batches the lr is 1/10000 of 1e-4 (a constant schedule would leave 1e-4).
    assert trainer.state.optimizers[0].param_groups[0]["lr"] == pytest.approx(1e-4 * 1 / 10000)
    assert sorted(p.name for p in (tmp_path / "checkpoints").glob("ep*.pt")) == ["ep0-ba2-rank0.pt"]
    # The end-of-training grid lands under the checkpoint folder (4 prompts x 2 guidance scales).
    assert (tmp_path / "checkpoints/samples/ba2.json").is_file()
