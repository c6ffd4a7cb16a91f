"""bench/gpu_check.py without a GPU: one clear line, and every configuration it would run is a valid
sd2-base config (so a GPU session does not spend its time on a typo)."""

import importlib.util
import warnings

import numpy as np
import pytest
import torch

from data.latents import LatentsDataset
from recipes import load_config, parse_config
from recipes.prepare import prepare_sd2_latents
from tests.conftest import REPO

spec = importlib.util.spec_from_file_location("gpu_check", REPO / "bench/gpu_check.py")
gpu_check = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gpu_check)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without CUDA")
def test_refuses_without_cuda_in_one_line():
    with pytest.raises(SystemExit) as exit_:
        gpu_check.main(["--out", "/nonexistent"])
    message = str(exit_.value.code)
    assert "CUDA" in message and "\n" not in message


@pytest.mark.parametrize("resolution", [256, 512])
@pytest.mark.parametrize("variant", list(gpu_check.VARIANTS))
def test_every_variant_is_a_valid_config(variant, resolution):
    micro, overrides = gpu_check.variant_overrides(8, resolution, gpu_check.VARIANTS[variant])
    bench = ["model.pretrained=null", "data.train.remote=null", "trainer.save_folder=null"]  # throughput.py's
    run = parse_config(load_config(REPO / "yamls/sd2-base.yaml", [*overrides, *bench]))
    assert run.data.train.latents and run.data.train.resolution == resolution
    assert run.trainer["device_train_microbatch_size"] == micro and run.global_train_batch_size == 8 * micro


def test_e2e_config_keeps_the_recipe_and_adds_ema(tmp_path):
    overrides = [*gpu_check.e2e_overrides(2, tmp_path), f"trainer.save_folder={tmp_path}"]
    run = parse_config(load_config(REPO / "yamls/sd2-base.yaml", overrides))
    assert run.model["preset"] == "sd2-base" and run.model["fsdp_wrap"] == "blocks"
    assert set(run.algorithms) == {"gradient_clipping", "ema"} and not run.loggers
    assert run.trainer["parallelism_config"]["fsdp"]["sharding_strategy"] == "SHARD_GRAD_OP"


def test_sd2_latents_are_shaped_like_convert_latents(tmp_path):
    local = prepare_sd2_latents(tmp_path / "latents", n=3, resolutions=(256,))
    assert prepare_sd2_latents(local) == local  # made once
    dataset = LatentsDataset(local=str(local), resolution=256, batch_size=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "non-writable NumPy array" warning in every worker
        sample = dataset[0]
    assert sample["latents"].shape == (8, 32, 32) and sample["text_embeds"].shape == (77, 1024)
    assert np.isfinite(sample["latents"].numpy()).all()


def test_plain_loop_ceiling_trains_the_recipes_model():
    """The ceiling row (a plain loop over the same model) runs the real model's loss and optimizer;
    here on the tiny preset on the CPU, where it must report a positive rate and no GPU memory."""
    img_s, peak = gpu_check.plain_loop("tiny", 32, batch=2, steps=2, warmup=1, device="cpu")
    assert img_s > 0 and peak is None


def test_table_reports_the_training_path_against_the_plain_loop():
    rows = [
        {"variant": "baseline", "resolution": 256, "microbatch": 32, "ok": True, "img_s": 100.0,
         "memory_gb": 18.0, "mfu": 0.05},
        {"variant": gpu_check.PLAIN, "resolution": 256, "microbatch": 32, "ok": True, "img_s": 200.0,
         "memory_gb": None, "mfu": 0.10},
    ]  # fmt: skip
    text = gpu_check.table(rows)
    assert "baseline / plain loop at 256 px: 0.50x" in text and "| 200.0 | 10.0% | ? |" in text
