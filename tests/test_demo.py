"""`make demo`, shortened: the whole path runs and the model learns to follow its prompts (the quick
variant overfits three prompts that differ in colour and shape; see QUICK in the demo driver)."""

import json

import pytest

from demo.lora_stage import QUICK_LORA, SAME_IMAGES
from demo.run import QUICK, RECIPES, YAMLS, main
from recipes import load_config, parse_config

# Well above chance (1/3 for three prompts). Measured after 450 batches, one thread: colour 100%,
# shape 75% over 12 images (2026-11-26).
QUICK_COLOR, QUICK_SHAPE = 0.75, 0.6


@pytest.mark.heavy
def test_every_preset_trains_its_own_model_and_has_quick_settings():
    """`--preset P` trains P (not another preset's recipe), and `--quick` has settings for it that its
    recipe takes and that never lengthen it (the quick run trains on three prompts' images; zimage-tiny
    and flux2-tiny need their full 1,000 batches even on those: QUICK's comments)."""
    assert {"tiny", "mmdit-tiny", "flux-tiny", "zimage-tiny"} <= set(RECIPES)
    for preset, recipe in RECIPES.items():
        runs = [parse_config(load_config(YAMLS / recipe, o)) for o in ([], QUICK["diffusion"][preset])]
        assert [run.model["preset"] for run in runs] == [preset, preset], recipe
        full, quick = (int(run.trainer["max_duration"].removesuffix("ba")) for run in runs)
        assert quick <= full, (preset, quick, full)


@pytest.mark.slow
@pytest.mark.fit
@pytest.mark.subprocess  # a DataLoader worker
# Beyond the suite's 600 s: ~125 s on a quiet machine before the LoRA stage, which adds ~80 s
# (2026-11-29); 4 agents' work on the 2 cores once made the stages before it take 590 s.
@pytest.mark.timeout(1500)
def test_quick_demo_learns_to_follow_the_shape(tmp_path, monkeypatch, capfd):
    # In this process, which has imported the stack already (a subprocess spent ~8 s of CPU on it),
    # with one thread like every test process: the other pytest worker has the second core. (With
    # two threads beside it this test took 225 s instead of ~100 s, and slowed the other worker too.)
    monkeypatch.chdir(tmp_path)  # the recipes' runs/ paths land here, not in the checkout
    monkeypatch.setenv("WANDB_MODE", "offline")
    main(["--quick", "--threads", "1"])  # capfd, not capsys: the progress bar asks for a file descriptor
    stdout = capfd.readouterr().out
    out = tmp_path / "runs/demo"
    summary = json.loads((out / "summary.json").read_text())
    assert summary["vae_reconstruction"]["color"] >= 0.9
    samples = summary["samples"]
    assert samples["images"] == 12
    assert samples["color"] >= QUICK_COLOR and samples["shape"] >= QUICK_SHAPE, samples
    manifest = json.loads((out / "samples/manifest.json").read_text())
    assert {row["prompt"] for row in manifest} == {"a red circle", "a green square", "a blue triangle"}
    assert len(manifest) == 12 and all((out / "samples" / row["file"]).is_file() for row in manifest)
    assert f"manifest:   {(out / 'samples/manifest.json').resolve()}" in stdout
    # The training stage drew its sample grid at the end (extensions/sample_grids.py, yamls/tiny-cpu.yaml).
    grids = tmp_path / "runs/tiny-cpu/checkpoints/samples"
    assert (grids / "ba450.png").is_file() and json.loads((grids / "ba450.json").read_text())["ema"]
    # It ends with evaluation.evaluate on held-out shapes at two guidance scales, table printed.
    assert [row["guidance"] for row in summary["metrics"]] == [1, 4]
    assert all(row["n"] == 24 and row["fid"] > 0 for row in summary["metrics"])
    assert "| guidance | images | FID | KID (x1000) | CLIP score |" in stdout
    assert (out / "metrics/fid-vs-clip.png").is_file() and (out / "metrics/samples.png").is_file()
    # The LoRA stage (demo/lora_stage.py): the adapter taught "a red cross" (which the base never saw),
    # kept the old prompts, and diffusers with its exported file drew the same images as our model.
    lora = summary["lora"]
    assert lora["passed"], lora
    assert lora["concept_after"]["shape"] >= QUICK_LORA["gates"]["concept"]
    assert lora["diffusers"]["max_abs_diff"] <= SAME_IMAGES and lora["diffusers"]["same_verdicts"] == 1.0
    assert (out / "lora/export/pytorch_lora_weights.safetensors").is_file()
    assert "LoRA stage: " in stdout


@pytest.mark.slow
@pytest.mark.fit
@pytest.mark.subprocess  # a DataLoader worker
# Beyond the suite's 600 s: 1,000 diffusion batches of the transformer on one thread (flux2-tiny's
# diffusion stage 185 s at 700, zimage-tiny's 436 s at 1,000 on a loaded machine, 2026-11-29).
@pytest.mark.timeout(1500)
@pytest.mark.parametrize("preset", ["zimage-tiny", "flux2-tiny"])
def test_quick_demo_gates_the_llm_conditioned_families(preset, tmp_path, monkeypatch, capfd):
    """The families conditioned on an LLM's hidden states (issue 50) learn the quick demo's prompts as
    the UNet does: `python -m demo --quick --preset P`, their own quick settings, the same gates."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("WANDB_MODE", "offline")
    summary = main(["--quick", "--threads", "1", "--preset", preset])
    stdout = capfd.readouterr().out
    assert summary["preset"] == preset and summary["gates"]["passed"], summary
    samples = summary["samples"]
    assert samples["images"] == 12 and samples["color"] >= QUICK_COLOR and samples["shape"] >= QUICK_SHAPE
    assert summary["lora"] is None  # the LoRA stage adapts the tiny UNet only
    assert "passed the gates" in stdout
