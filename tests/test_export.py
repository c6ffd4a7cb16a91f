"""models.export: a tiny EMA run's checkpoint -> diffusers pipeline folders that sample like the model."""

from pathlib import Path

import pytest
import torch
from diffusers import AutoencoderKL, StableDiffusionPipeline, UNet2DConditionModel
from transformers import CLIPTextModel

from models import export
from models.export import load_model_from_checkpoint

PROMPTS = ["a red circle", "a blue square"]


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoint) -> Path:
    return tiny_checkpoint


@pytest.fixture(scope="module")
def saved(checkpoint) -> dict:
    return torch.load(checkpoint, weights_only=False)["state"]


@pytest.fixture(scope="module")
def exports(checkpoint, tmp_path_factory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("export")
    export.main([str(checkpoint), str(out / "ema"), "--ema"])
    export.main([str(checkpoint), str(out / "raw"), "--raw"])
    return {"ema": out / "ema", "raw": out / "raw"}


def _ema(saved) -> dict:
    (name, state), *_ = saved["algorithms"]
    assert name == "EMA" and state["ema"]
    return state["ema"]


def _component(folder: Path, cls, subfolder: str) -> dict:
    return cls.from_pretrained(folder, subfolder=subfolder, local_files_only=True).state_dict()


def test_pipeline_samples_like_generate(checkpoint, exports):
    model = load_model_from_checkpoint(checkpoint, ema=True)
    expected = model.generate(PROMPTS, guidance_scale=4.0, num_inference_steps=5, seed=3, sampler="ddim")
    pipe = StableDiffusionPipeline.from_pretrained(exports["ema"], local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    assert type(pipe.scheduler).__name__ == "DDIMScheduler" and pipe.safety_checker is None
    # generate() draws its noise from a seeded CPU generator; the pipeline scales `latents` by
    # init_noise_sigma itself, as generate() does.
    latents = torch.randn((2, 4, 8, 8), generator=torch.Generator().manual_seed(3))
    images = pipe(
        PROMPTS, latents=latents, guidance_scale=4.0, num_inference_steps=5, output_type="pt"
    ).images
    assert images.shape == expected.shape == (2, 3, 32, 32)
    torch.testing.assert_close(images, expected, atol=1e-6, rtol=0)


def test_ema_and_raw_exports_hold_the_checkpoint_weights(saved, exports):
    ema, raw = _ema(saved), saved["model"]
    unet_ema = _component(exports["ema"], UNet2DConditionModel, "unet")
    unet_raw = _component(exports["raw"], UNet2DConditionModel, "unet")
    assert unet_ema.keys() == unet_raw.keys() == {k.removeprefix("unet.") for k in ema}
    assert all(torch.equal(unet_ema[k], ema[f"unet.{k}"]) for k in unet_ema)
    assert all(torch.equal(unet_raw[k], raw[f"unet.{k}"]) for k in unet_raw)
    assert any(not torch.equal(unet_ema[k], unet_raw[k]) for k in unet_ema)
    # The frozen parts are the same in both exports: exactly the checkpoint's.
    for kind in ("ema", "raw"):
        for cls, name in ((AutoencoderKL, "vae"), (CLIPTextModel, "text_encoder")):
            state = _component(exports[kind], cls, name)
            assert all(torch.equal(v, raw[f"{name}.{k}"]) for k, v in state.items()), (kind, name)


def test_default_is_ema_when_present(checkpoint, saved):
    model = load_model_from_checkpoint(checkpoint, ema=None)
    ema = _ema(saved)
    assert all(torch.equal(v, ema[f"unet.{k}"]) for k, v in model.unet.state_dict().items())
    assert not model.unet.training and not any(p.is_meta for p in model.parameters())
    assert model.text_encoder.embeddings.position_ids.tolist() == [list(range(77))]


@pytest.mark.parametrize("algorithms", [[], [("EMA", {"start_batch": None, "ema": None})]])
def test_ema_without_an_average_is_an_error(checkpoint, tmp_path, algorithms):
    full = torch.load(checkpoint, weights_only=False)
    full["state"]["algorithms"] = algorithms  # no EMA algorithm, or saved before ema_start
    no_ema = tmp_path / "no-ema.pt"
    torch.save(full, no_ema)
    with pytest.raises(SystemExit, match="has no EMA weights"):  # the CLI's one-line error
        export.main([str(no_ema), str(tmp_path / "out"), "--ema"])
    model = load_model_from_checkpoint(no_ema, ema=None)  # the default falls back to the raw weights
    raw = full["state"]["model"]
    assert all(torch.equal(v, raw[f"unet.{k}"]) for k, v in model.unet.state_dict().items())


def test_missing_checkpoint_is_named(tmp_path):
    missing = tmp_path / "nope" / "ep0-ba3-rank0.pt"
    with pytest.raises(SystemExit, match="checkpoint not found: .*nope/ep0-ba3-rank0.pt"):
        export.main([str(missing), str(tmp_path / "out")])
    assert not (tmp_path / "out").exists()


def test_preset_of_an_unrecorded_checkpoint_is_checked_against_the_shapes(checkpoint, tmp_path):
    full = torch.load(checkpoint, weights_only=False)
    del full["state"]["callbacks"]["ModelRecord"]  # as written before checkpoints carried a record
    old = tmp_path / "old.pt"
    torch.save(full, old)
    with pytest.raises(ValueError, match="does not hold preset 'sd2-base'"):
        load_model_from_checkpoint(old, ema=False, preset="sd2-base")
    full["state"]["model"]["unet.conv_in.weight"] = torch.zeros(7, 4, 3, 3)
    odd = tmp_path / "odd.pt"
    torch.save(full, odd)
    with pytest.raises(ValueError, match=r"match no preset.*tiny: unet.conv_in.weight is \(7, 4, 3, 3\)"):
        load_model_from_checkpoint(odd, ema=False)


def test_sd2_base_is_inferred_from_its_shapes():
    shapes = export._preset_shapes("sd2-base")  # meta-device shapes: no 5 GB of weights in the test
    weights = {k: torch.empty(shape, device="meta") for k, shape in shapes.items()}
    assert export.infer_preset(weights) == "sd2-base"


@pytest.mark.fit
def test_a_composer_ema_checkpoint_exports_its_average(shapes_mds, tmp_path):
    """composer.algorithms.EMA swaps its average into the model for every save and keeps the raw
    weights in its own state: export must take the average by default and the raw ones with --raw."""
    from recipes import build_trainer, load_config
    from tests.conftest import REPO, tiny_run

    overrides = [
        *tiny_run(shapes_mds, 3),
        f"trainer.save_folder={tmp_path}",
        "trainer.save_filename=ckpt.pt",
        "algorithms.ema._target_=composer.algorithms.EMA",
        "algorithms.ema.half_life=2ba",
    ]
    trainer = build_trainer(load_config(REPO / "yamls/tiny-cpu.yaml", overrides))
    trainer.fit()
    trainer.close()
    state = torch.load(tmp_path / "ckpt.pt", weights_only=False)["state"]
    (name, ema), *_ = state["algorithms"]
    assert name == "EMA" and ema["ema_weights_active"] and ema["ema_started"]  # what Composer writes
    average = {k: v for k, v in state["model"].items() if k.startswith("unet.")}
    raw = ema["ema_model"]["named_parameters_dict"]
    assert average.keys() == raw.keys() and any(not torch.equal(average[k], raw[k]) for k in raw)

    for flag, expected in ((None, average), (True, average), (False, raw)):
        unet = load_model_from_checkpoint(tmp_path / "ckpt.pt", ema=flag).unet.state_dict()
        assert all(torch.equal(v, expected[f"unet.{k}"]) for k, v in unet.items()), flag

    state["algorithms"] = [("EMA", {"shadow": {}})]  # an EMA this code does not know
    torch.save({"state": state}, tmp_path / "unknown.pt")
    with pytest.raises(ValueError, match=r"EMA state has keys \['shadow'\].*--raw"):
        load_model_from_checkpoint(tmp_path / "unknown.pt")
