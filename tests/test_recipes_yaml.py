"""Every recipe in yamls/ composes, validates and (shrunk to the tiny preset) trains."""

import json
import shutil

import pytest
import torch
import yaml
from composer.algorithms.low_precision_groupnorm.low_precision_groupnorm import LPGroupNorm
from composer.algorithms.low_precision_layernorm.low_precision_layernorm import LPLayerNorm
from composer.loggers import WandBLogger
from hydra.utils import get_object
from omegaconf import OmegaConf
from PIL import Image

from compat.torch import is_compiled
from data.image_caption import ImageCaptionDataset
from extensions.master_weights import MasterWeightAdamW
from extensions.watchdog import dist_timeout
from models import build_model
from models.checkpoints.record import describe
from models.training.torch_compile import compiles_with_cudagraphs
from recipes import ConfigError, build_trainer, load_config, parse_config
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
    "sdxl-base": [
        "data.train.remote=s3://bucket/mds",
        "model.pretrained=/models/sdxl",
        "trainer.save_folder=/ckpt-xl",
    ],
    "sdxl-finetune": [
        "data.train.local=/data/mds",
        "model.pretrained=/models/sdxl",
        "trainer.save_folder=/ft",
    ],
    "sdxl-lora": ["data.train.local=/data/mds", "model.pretrained=/models/sdxl", "trainer.save_folder=/lora"],
    "sd3-medium": [
        "data.train.remote=s3://bucket/mds",
        "model.pretrained=/models/sd3",
        "trainer.save_folder=/ckpt-sd3",
    ],
    "sd3-finetune": ["data.train.local=/data/mds", "model.pretrained=/models/sd3", "trainer.save_folder=/ft"],
    "flux-schnell-mlperf": [
        "data.train.remote=s3://bucket/cc12m-flux",
        "data.eval.remote=s3://bucket/coco-flux",
        "model.pretrained=/models/flux-schnell",
        "trainer.save_folder=/ckpt-flux",
    ],
    "flux-finetune": [
        "data.train.local=/data/mds",
        "model.pretrained=/models/flux-dev",
        "trainer.save_folder=/ft",
    ],
    "flux-lora": [
        "data.train.local=/data/mds",
        "model.pretrained=/models/flux-dev",
        "trainer.save_folder=/lora",
    ],
    "zimage-finetune": [
        "data.train.local=/data/mds",
        "model.pretrained=/models/z-image",
        "trainer.save_folder=/ft",
    ],
    "zimage-lora": [
        "data.train.local=/data/mds",
        "model.pretrained=/models/z-image",
        "trainer.save_folder=/lora",
    ],
    "flux2-klein-finetune": [
        "data.train.local=/data/mds",
        "model.pretrained=/models/flux2-klein-base-4b",
        "trainer.save_folder=/ft",
    ],
    "flux2-klein-lora": [
        "data.train.local=/data/mds",
        "model.pretrained=/models/flux2-klein-base-4b",
        "trainer.save_folder=/lora",
    ],
    **{
        f"{family}-dreambooth": [
            f"model.pretrained=/models/{family}",
            "dreambooth.instance_dir=/data/subject",
            "trainer.save_folder=/db",
        ]
        for family in ("sd2", "sdxl", "sd3", "flux", "zimage", "flux2")
    },
    "tiny-dreambooth-cpu": ["dreambooth.instance_dir=/data/subject"],
    "tiny-cpu": [],
    "tiny-flux-cpu": [],
    "tiny-lora-concept-cpu": [],
    "tiny-mmdit-cpu": [],
    "tiny-sdxl-cpu": [],
    "tiny-zimage-cpu": [],
    "tiny-flux2-cpu": [],
    "tiny-vae": [],
}


@pytest.mark.parametrize("name", sorted(REQUIRED))
@pytest.mark.heavy
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
    # Stage 2 refines stage 1's weights at a higher resolution: it loads the weights alone (a fresh
    # optimizer, schedule and batch count), and its EMA starts inside the run, so it averages something.
    assert stage2["data.train.resolution"] > base["data.train.resolution"]
    assert stage2["trainer.load_weights_only"] is True
    ema_start, duration = (_batches(stage2[k]) for k in ("algorithms.ema.ema_start", "trainer.max_duration"))
    assert 0 < ema_start < duration
    assert 0 < stage2["algorithms.ema.smoothing"] < 1


def _batches(duration: str) -> int:
    assert duration.endswith("ba"), duration
    return int(duration.removesuffix("ba"))


def _name(target: str) -> str:
    return target.rsplit(".", 1)[-1]


@pytest.mark.fit
def test_sd2_base_wiring_trains_on_the_tiny_preset(shapes_mds, tmp_path):
    """The sd2-base recipe as it would run on 8 GPUs, only the preset shrunk to tiny: the objects and
    settings handed to composer.Trainer are what the composed recipe says (read back from it, not
    restated here); then, with what a CPU cannot run swapped out, two batches."""
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
    recipe = OmegaConf.to_container(load_config(YAMLS / "sd2-base.yaml", given))
    if not torch.cuda.is_available():  # refused before anything is built
        with pytest.raises(ConfigError, match="'trainer.device' is gpu"):
            build_trainer(run)

    world = 8
    kwargs = trainer_kwargs(run, world_size=world)
    # trainer: every key of the YAMLs (read here without Hydra) passes through unchanged, but for the
    # microbatch, a cap; dist_timeout is the hang watchdog's (extensions/watchdog.py).
    base, sd2 = (yaml.safe_load((YAMLS / f"{n}.yaml").read_text()) for n in ("_base", "sd2-base"))
    expected = {**base["trainer"], **sd2["trainer"], "save_folder": "s3://bucket/checkpoints/sd2-base-256"}
    expected["dist_timeout"] = dist_timeout(recipe["callbacks"], None)
    recipe_keys = {"run_name", "seed", "model", "train_dataloader", "eval_dataloader", "optimizers"}
    recipe_keys |= {"schedulers", "algorithms", "callbacks", "loggers"}
    assert kwargs.keys() == recipe_keys | expected.keys()
    cap = expected.pop("device_train_microbatch_size")  # a cap, checked below
    assert {k: kwargs[k] for k in expected} == expected
    assert (kwargs["run_name"], kwargs["seed"]) == (recipe["run_name"], recipe["seed"])
    # The batch split on 8 devices: the devices' batches add up to the global batch, and the
    # microbatch is the largest divisor of a device's batch not above the YAML's cap.
    loader = kwargs["train_dataloader"]
    assert loader.batch_size == loader.dataset.batch_size
    assert loader.batch_size * world == recipe["global_train_batch_size"]
    micro = kwargs["device_train_microbatch_size"]
    assert micro <= cap and loader.batch_size % micro == 0
    assert not any(loader.batch_size % d == 0 for d in range(micro + 1, cap + 1))
    # Data: the YAML's loader and streaming settings, the remote and local the user gave.
    train = recipe["data"]["train"]
    assert loader.num_workers == train["num_workers"] and loader.drop_last
    assert kwargs["eval_dataloader"] is None  # no data.eval in the recipe
    dataset = loader.dataset
    assert isinstance(dataset, ImageCaptionDataset) and dataset.hflip == train["hflip"] and dataset.shuffle
    [stream] = dataset.streams
    assert (stream.remote, stream.local) == ("s3://bucket/laion-mds", str(tmp_path / "cache"))
    assert dataset.num_canonical_nodes == train["num_canonical_nodes"]
    resolution = train["resolution"]
    assert dataset[0]["image"].shape == (3, resolution, resolution)  # read from the filled cache
    # Model: LP norms on the UNet, caption dropout, the frozen parts from the pretrained folder.
    model = kwargs["model"]
    assert model.caption_drop_prob == recipe["model"]["caption_drop_prob"]
    assert model.prediction_type == "epsilon"  # SD2 base predicts the noise (768-v predicts v)
    assert recipe["model"]["low_precision_norms"] is not None
    assert any(isinstance(m, LPGroupNorm) for m in model.unet.modules())
    assert any(isinstance(m, LPLayerNorm) for m in model.unet.modules())
    for name in ("vae", "text_encoder"):
        mine, theirs = getattr(model, name).state_dict(), getattr(source, name).state_dict()
        assert all(mine[k].equal(v) for k, v in theirs.items())
    # The step (yamls/_step/compiled.yaml): bf16 weights, channels-last, compiled in place.
    assert model.unet.dtype == getattr(torch, recipe["model"]["param_dtype"])
    conv = next(m for m in model.unet.modules() if isinstance(m, torch.nn.Conv2d))
    assert conv.weight.is_contiguous(memory_format=torch.channels_last) == recipe["model"]["channels_last"]
    assert is_compiled(model.unet) == bool(recipe["model"]["compile_unet"])
    # Optimizer on the UNet alone, with the recipe's hyperparameters (and, for bf16 weights, the
    # fp32 master weights: extensions/master_weights.py's subclass of the recipe's AdamW).
    optimizer, settings = kwargs["optimizers"], dict(recipe["optimizer"])
    assert isinstance(optimizer, get_object(settings.pop("_target_")))
    assert isinstance(optimizer, MasterWeightAdamW) == (recipe["model"]["param_dtype"] == "bfloat16")
    optimized = {id(p) for group in optimizer.param_groups for p in group["params"]}
    assert optimized == {id(p) for p in model.unet.parameters()}
    # torch 2.14 keeps betas as a tuple; the YAML gives a list.
    assert {k: optimizer.defaults[k] for k in settings} == {
        k: tuple(v) if isinstance(v, list) else v for k, v in settings.items()
    }
    scheduler, schedule = kwargs["schedulers"], recipe["scheduler"]
    assert type(scheduler).__name__ == _name(schedule["_target_"])
    assert (str(scheduler.t_warmup), scheduler.alpha_f) == (schedule["t_warmup"], schedule["alpha_f"])
    # Algorithms and callbacks: one object per entry of the recipe, found by class, not by position.
    algorithms = {type(a).__name__: a for a in kwargs["algorithms"]}
    assert algorithms.keys() == {_name(a["_target_"]) for a in recipe["algorithms"].values()}
    clipping = recipe["algorithms"]["gradient_clipping"]
    clipper = algorithms[_name(clipping["_target_"])]
    assert (clipper.clipping_type, clipper.clipping_threshold) == (
        clipping["clipping_type"],
        clipping["clipping_threshold"],
    )
    callbacks = {type(c).__name__: c for c in kwargs["callbacks"]}
    assert len(callbacks) == len(kwargs["callbacks"])
    configured = {_name(c["_target_"]) for c in recipe["callbacks"].values() if c is not None}
    # The record is added to every run; under CUDA graphs, gradient buffers of their own.
    graphs = compiles_with_cudagraphs(recipe["model"]["compile_unet"])
    assert callbacks.keys() == configured | {"ModelRecord", *["PersistentGradients"] * graphs}
    assert callbacks["ModelRecord"].state_dict()["unet"] == describe(model)["unet"]  # in every checkpoint
    grids, samples = callbacks["SampleGrids"], recipe["callbacks"]["samples"]
    assert (grids.prompts, grids.per_prompt, grids.guidance, grids.steps) == (
        samples["prompts"],
        samples["per_prompt"],
        samples["guidance"],
        samples["steps"],
    )
    speed = recipe["callbacks"]["speed_monitor"]
    assert callbacks["SpeedMonitor"].history_samples.maxlen == speed["window_size"] + 1
    guard = recipe["callbacks"]["nan_guard"]
    assert (callbacks["NaNGuard"].check_inf, callbacks["NaNGuard"].save_last_good) == (
        guard["check_inf"],
        guard["save_last_good"],
    )
    [logger] = kwargs["loggers"]
    assert isinstance(logger, WandBLogger) and logger.project == recipe["loggers"]["wandb"]["project"]

    # Two batches on the CPU: the same recipe but for the device, precision, the step (CUDA graphs
    # and a capturable optimizer are refused on the CPU), wandb and the GPU memory monitor, with 32 px
    # images and a batch the 64-image set holds.
    with pytest.raises(ConfigError, match="_step=eager"):
        build_trainer(
            load_config(YAMLS / "sd2-base.yaml", given + ["trainer.device=cpu", "trainer.precision=fp32"])
        )
    cpu = [
        "_step=eager",
        f"data.train.local={tmp_path / 'cpu-cache'}",
        "data.train.resolution=32",
        "data.train.num_workers=0",
        "global_train_batch_size=8",
        "trainer.device_train_microbatch_size=4",
        "trainer.device=cpu",
        "trainer.precision=fp32",
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
    # two batches the lr is 1/t_warmup of the recipe's (a constant schedule would leave it unchanged).
    lr = trainer.state.optimizers[0].param_groups[0]["lr"]
    assert lr == pytest.approx(recipe["optimizer"]["lr"] / _batches(recipe["scheduler"]["t_warmup"]))
    assert sorted(p.name for p in (tmp_path / "checkpoints").glob("ep*.pt")) == ["ep0-ba2-rank0.pt"]
    # The end-of-training grid lands under the checkpoint folder: a row per (guidance, prompt), one
    # 32 px picture per prompt (per_prompt=1), 2 px padding around each.
    grid = tmp_path / "checkpoints/samples/ba2.png"
    rows = len(samples["guidance"]) * len(samples["prompts"])
    assert Image.open(grid).size == (1 * (32 + 2) + 2, rows * (32 + 2) + 2)
    record = json.loads(grid.with_suffix(".json").read_text())
    assert record["batch"] == 2 and len(record["rows"]) == rows
