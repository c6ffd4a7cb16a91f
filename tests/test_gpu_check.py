"""bench/gpu/gpu_check.py without a GPU: one clear line, every configuration it would run is a valid config
of its preset (so a GPU session does not spend its time on a typo), the e2e check's verdicts, the
random latents and the plain-loop ceiling. Its runner, bench/gpu/gpu_runs.py: tests/test_gpu_runs.py."""

import importlib.util
import json
import sys
import warnings

import numpy as np
import pytest
import torch

from data.latent_dataset import LatentsDataset
from recipes import load_config, parse_config, prepare
from recipes.prepare import prepare_sd2_latents
from tests.conftest import REPO

spec = importlib.util.spec_from_file_location("gpu_check", REPO / "bench/gpu/gpu_check.py")
gpu_check = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gpu_check)
gpu_e2e = sys.modules["bench.gpu.gpu_e2e"]
gpu_runs = sys.modules["bench.gpu.gpu_runs"]
plain_loop = sys.modules["bench.plain_loop"]


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
    batch = gpu_check.batch_sizes(resolution, gpu_check.VARIANTS[variant])[1]  # 2 microbatches: twice
    assert run.trainer["device_train_microbatch_size"] == micro and run.global_train_batch_size == 8 * batch


def test_the_combination_with_2_microbatches_differs_only_in_its_batch():
    """CUDA graphs with gradient accumulation (a known hazard): the combination's overrides, with a
    global batch of two microbatches per GPU."""
    full = gpu_check.variant_overrides(2, 256, gpu_check.VARIANTS[gpu_runs.FULL])
    two = gpu_check.variant_overrides(2, 256, gpu_check.VARIANTS[gpu_runs.FULL_2])
    assert full[0] == two[0] == 32
    assert [o.replace("=128", "=64") for o in two[1]] == full[1] and "global_train_batch_size=128" in two[1]


# The presets measured through a recipe on random latents (flux-schnell's depth job makes none).
RECIPE_TARGETS = sorted(p for p, target in gpu_check.TARGETS.items() if "depth" not in target)


@pytest.mark.parametrize("preset", RECIPE_TARGETS)
def test_the_latents_hold_every_variants_batches_in_one_epoch(monkeypatch, tmp_path, preset):
    """The random latents a throughput variant reads hold the warm-up, timed and profiled batches of
    the preset's largest batch per GPU in one epoch, on any number of GPUs, at the measured size only;
    the count names the folder (a folder made for fewer is not reused). sd2-base at 256 px on one
    GPU: 64 x 29 = 1,856 samples (~310 MB)."""
    made = []
    monkeypatch.setattr(prepare, "prepare_random_latents", lambda *a, **k: made.append((a, k)) or a[0])
    target = gpu_check.TARGETS[preset]
    for px in target["microbatch"]:
        for gpus in (1, 8):
            folder = gpu_check.latents(tmp_path, preset, px, gpus, batches=20)
            (local, preset_made), kwargs = made[-1]
            assert local == folder and preset_made == preset and kwargs["resolutions"] == (px,)
            assert folder.name.endswith(f"-{px}px-{kwargs['n']}")
            for variant in target["variants"].values():
                batch = gpu_check.batch_sizes(px, variant, preset)[1]
                assert batch * gpus * (gpu_check.WARMUP + 20 + gpu_check.PROFILE_STEPS) < kwargs["n"]
    if preset == "sd2-base":
        assert gpu_check.latents(tmp_path, preset, 256, 1, batches=20).name == "latents-sd2-base-256px-1856"


FAMILY_CASES = [
    (preset, variant, resolution)
    for preset in ("sdxl-base", "sd3-medium")
    for variant in gpu_check.TARGETS[preset]["variants"]
    for resolution in gpu_check.TARGETS[preset]["microbatch"]
]


@pytest.mark.parametrize(("preset", "variant", "resolution"), FAMILY_CASES)
@pytest.mark.heavy
def test_every_sdxl_and_sd3_variant_is_a_valid_config(preset, variant, resolution):
    target = gpu_check.TARGETS[preset]
    micro, overrides = gpu_check.variant_overrides(8, resolution, target["variants"][variant], preset)
    bench = ["model.pretrained=null", "data.train.remote=null", "trainer.save_folder=null"]
    run = parse_config(load_config(REPO / target["recipe"], [*overrides, *bench]))
    assert run.model["preset"] == preset and run.data.train.latents and not run.data.train.buckets
    assert run.data.train.prepare == target["data"] and run.data.train.resolution == resolution
    assert run.trainer["device_train_microbatch_size"] == micro and run.global_train_batch_size == 8 * micro


@pytest.mark.heavy
def test_sdxl_latents_hand_the_model_what_it_reads(tmp_path):
    """The random SDXL latents give the model a batch it trains on: context, pooled vector and
    micro-conditioning, with the sdxl-base shapes."""
    from recipes.prepare import prepare_random_latents

    local = prepare_random_latents(tmp_path / "xl", "sdxl-base", n=2, resolutions=(512,))
    sample = LatentsDataset(local=str(local), resolution=512, batch_size=1)[0]
    assert sample["latents"].shape == (8, 64, 64) and sample["text_embeds"].shape == (77, 2048)
    assert sample["pooled_text_embeds"].shape == (1280,)
    assert sample["original_size"].tolist() == [512, 512] and sample["crop_top_left"].tolist() == [0, 0]


@pytest.mark.parametrize("deterministic", [False, True])
def test_e2e_config_keeps_the_recipe_and_adds_ema(tmp_path, deterministic):
    overrides = [*gpu_e2e.e2e_overrides(2, tmp_path), *gpu_e2e.run_overrides(tmp_path, deterministic)]
    run = parse_config(load_config(REPO / "yamls/sd2-base.yaml", overrides))
    assert run.model["preset"] == "sd2-base" and run.model["fsdp_wrap"] == "blocks"
    assert set(run.algorithms) == {"gradient_clipping", "ema"} and not run.loggers
    assert "parallelism_config" not in run.trainer  # the recipe's DDP (no wrapper on one GPU)
    assert run.callbacks["loss_log"]["path"] == str(tmp_path / "loss.jsonl")
    assert run.trainer.get("deterministic_mode", False) is deterministic


def _e2e_runs(tmp_path, loss_b_shift=0.0, weight_noise=0.0):
    """Two fake e2e runs: loss logs as LossLog writes them and checkpoint states."""
    torch.manual_seed(0)
    state = {
        "model": {"unet.w": torch.randn(4, 4), "step": torch.tensor(3)},
        "algorithms": {"ema": [torch.ones(2)]},
    }
    other = {
        "model": {"unet.w": state["model"]["unet.w"] + weight_noise, "step": torch.tensor(3)},
        "algorithms": {"ema": [torch.ones(2)]},
    }
    for folder, shift, batches in (("a", 0.0, range(1, 51)), ("b", loss_b_shift, range(26, 51))):
        (tmp_path / folder).mkdir()
        log = "\n".join(f'{{"batch": {i}, "loss": {0.5 + i / 1000 + shift}}}' for i in batches)
        (tmp_path / folder / "loss.jsonl").write_text(log + "\n")
    return tmp_path / "a", tmp_path / "b", state, other


def test_e2e_accepts_kernel_noise_but_not_a_resume_that_changes_the_losses(tmp_path):
    a, b, state, other = _e2e_runs(tmp_path, weight_noise=1e-7)
    problems, lines = gpu_e2e.compare_runs(a, b, state, other, bitwise=False)
    assert not problems and "model: 1 of 2 tensors differ" in "\n".join(lines)
    problems, _ = gpu_e2e.compare_runs(a, b, state, other, bitwise=True)  # --deterministic
    assert problems == ["model: the resume from batch 25 is not bitwise the uninterrupted run"]


def test_e2e_flags_a_resume_whose_losses_move(tmp_path):
    a, b, state, _ = _e2e_runs(tmp_path, loss_b_shift=0.01)  # e.g. a different data order or RNG
    problems, _ = gpu_e2e.compare_runs(a, b, state, state, bitwise=False)
    assert len(problems) == 1 and "losses differ" in problems[0]


def test_sd2_latents_are_shaped_like_convert_latents(tmp_path):
    local = prepare_sd2_latents(tmp_path / "latents", n=3, resolutions=(256,))
    assert prepare_sd2_latents(local) == local  # made once
    dataset = LatentsDataset(local=str(local), resolution=256, batch_size=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "non-writable NumPy array" warning in every worker
        sample = dataset[0]
    assert sample["latents"].shape == (8, 32, 32) and sample["text_embeds"].shape == (77, 1024)
    assert np.isfinite(sample["latents"].numpy()).all()


@pytest.mark.heavy
def test_plain_loop_ceiling_trains_the_recipes_model(tmp_path):
    """The ceiling row (a plain loop over the same model) runs the real model's loss and optimizer;
    here on the tiny preset on the CPU, where it must report a positive rate and no GPU memory, and
    its profile no GPU activity."""
    profile = tmp_path / "profile.json"
    img_s, peak = plain_loop.plain_loop(
        "tiny", 32, batch=2, steps=2, warmup=1, device="cpu", profile=profile, variant=gpu_runs.PLAIN
    )
    assert img_s > 0 and peak is None
    summary = json.loads(profile.read_text())
    assert summary["variant"] == gpu_runs.PLAIN and summary["steps"] == 3
    assert summary["gpu_busy_fraction"] is None and summary["aten_ops_per_step"] > 100


@pytest.mark.parametrize("preset", ["sdxl-tiny", "mmdit-tiny", "flux-tiny"])
@pytest.mark.heavy
def test_plain_loop_builds_each_family_s_stored_batch(preset):
    """Its batch is the family's stored form (models/stored_form.py), so Flux's T5 context and pooled
    CLIP vector too, where it once built SD3's shapes for every transformer (issue 48)."""
    img_s, peak = plain_loop.plain_loop(preset, 32, batch=2, steps=1, warmup=0, device="cpu")
    assert img_s > 0 and peak is None


def test_table_reports_the_training_path_against_the_plain_loop():
    rows = [
        {"variant": "baseline", "resolution": 256, "microbatch": 32, "ok": True, "img_s": 100.0,
         "memory_gb": 18.0, "mfu": 0.05},
        {"variant": gpu_runs.PLAIN, "resolution": 256, "microbatch": 32, "ok": True, "img_s": 200.0,
         "memory_gb": None, "mfu": 0.10},
    ]  # fmt: skip
    rows[0].update(profile="p.json", gpu_busy=0.42, launches=2496.0, syncs=7.0)
    text = gpu_runs.table(rows, gpu_check.ANCHORS)
    assert "baseline / plain loop at 256 px: 0.50x" in text and "| 200.0 | 10.0% | ? |" in text
    assert "| 18.0 | 0.23x | 42% | 2,496 | 7 |" in text
