"""Checkpoints carry their model record; export and generate rebuild exactly that model without flags."""

import logging
import re

import pytest
import torch
from diffusers import StableDiffusionPipeline

from models import build_model
from models.checkpoints.record import describe, read_record
from models.export import export_pipeline, load_model_from_checkpoint
from models.generate import load_model
from models.registry import PRESETS

PROMPTS = ["a red circle", "a blue square"]


def _checkpoint_of(model, path):
    """A file with what a Composer checkpoint holds for export: the model's weights and the record
    that the recipes' ModelRecord callback writes (tests/test_export.py reads a real one)."""
    state = {"model": model.state_dict(), "callbacks": {"ModelRecord": describe(model)}, "algorithms": []}
    torch.save({"state": state}, path)
    return path


@pytest.fixture(scope="module")
def v_ztsnr(tmp_path_factory):
    """A tiny v-prediction, zero-terminal-SNR model (random weights), its checkpoint and export."""
    folder = tmp_path_factory.mktemp("v-ztsnr")
    torch.manual_seed(0)
    model = build_model("tiny", prediction_type="v_prediction", zero_terminal_snr=True).eval()
    checkpoint = _checkpoint_of(model, folder / "ckpt.pt")
    export_pipeline(load_model_from_checkpoint(checkpoint), folder / "pipeline")
    return model, checkpoint, folder / "pipeline"


def test_a_training_run_records_its_model_in_every_checkpoint(tiny_checkpoint):
    record = read_record(torch.load(tiny_checkpoint, weights_only=False)["state"])
    assert record["preset"] == "tiny" and record["prediction_type"] == "epsilon"
    assert record["zero_terminal_snr"] is False and record["latent_scale"] == pytest.approx(0.18215)
    assert record["unet"]["block_out_channels"] == [32, 64] and record["text_encoder"]["hidden_size"] == 32
    assert record["tokenizer"]["pad_token"] == "!"


@pytest.mark.heavy
def test_a_v_prediction_zero_terminal_snr_checkpoint_rebuilds_without_flags(v_ztsnr):
    model, checkpoint, _ = v_ztsnr
    loaded = load_model_from_checkpoint(checkpoint)
    assert loaded.prediction_type == "v_prediction" and loaded.zero_terminal_snr
    assert loaded.default_guidance_rescale == 0.7
    assert float(loaded.noise_scheduler.alphas_cumprod[-1]) == 0.0
    assert loaded.noise_scheduler.config.timestep_spacing == "trailing"
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), loaded.state_dict().values()))


def test_the_export_of_such_a_run_has_its_schedule(v_ztsnr):
    _, _, pipeline = v_ztsnr
    scheduler = StableDiffusionPipeline.from_pretrained(pipeline, local_files_only=True).scheduler.config
    assert scheduler.prediction_type == "v_prediction"
    assert scheduler.rescale_betas_zero_snr is True and scheduler.timestep_spacing == "trailing"


@pytest.mark.heavy
def test_pipeline_with_guidance_rescale_samples_like_generate(v_ztsnr):
    model, _, pipeline = v_ztsnr
    expected = model.generate(PROMPTS, guidance_scale=4.0, num_inference_steps=5, seed=3)  # rescale 0.7
    unrescaled = model.generate(
        PROMPTS, guidance_scale=4.0, num_inference_steps=5, seed=3, guidance_rescale=0
    )
    assert not torch.allclose(expected, unrescaled, atol=1e-4)  # the rescale changes the images
    pipe = StableDiffusionPipeline.from_pretrained(pipeline, local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    latents = torch.randn((2, 4, 8, 8), generator=torch.Generator().manual_seed(3))
    images = pipe(
        PROMPTS,
        latents=latents,
        guidance_scale=4.0,
        guidance_rescale=0.7,
        num_inference_steps=5,
        output_type="pt",
    ).images
    torch.testing.assert_close(images, expected, atol=1e-6, rtol=0)
    # The exported folder read back by models.generate samples the same too.
    again = load_model(pipeline).generate(PROMPTS, guidance_scale=4.0, num_inference_steps=5, seed=3)
    torch.testing.assert_close(again, expected, atol=1e-6, rtol=0)


@pytest.mark.parametrize(
    "flags, message",
    [
        (
            {"prediction_type": "epsilon"},
            "--prediction-type epsilon contradicts the checkpoint, which records "
            "prediction_type='v_prediction'",
        ),
        ({"preset": "sd2-base"}, "--preset sd2-base contradicts the checkpoint, which records preset='tiny'"),
    ],
)
def test_a_flag_that_contradicts_the_record_is_an_error(v_ztsnr, flags, message):
    with pytest.raises(ValueError, match=message):
        load_model_from_checkpoint(v_ztsnr[1], **flags)
    load_model_from_checkpoint(v_ztsnr[1], prediction_type="v_prediction", preset="tiny")  # agreeing: fine


@pytest.mark.heavy
def test_an_old_checkpoint_loads_by_inference_with_a_warning(v_ztsnr, tmp_path, caplog):
    full = torch.load(v_ztsnr[1], weights_only=False)
    del full["state"]["callbacks"]
    torch.save(full, tmp_path / "old.pt")
    with caplog.at_level(logging.WARNING):
        model = load_model_from_checkpoint(tmp_path / "old.pt", prediction_type="v_prediction")
    assert "has no model record" in caplog.text
    assert model.preset == "tiny" and model.prediction_type == "v_prediction"
    assert not model.zero_terminal_snr  # what the record exists for: shapes alone cannot tell


@pytest.mark.fit
def test_an_autoencoder_runs_checkpoint_records_its_preset_and_is_refused_in_one_line(
    shapes_mds, tmp_path, capsys, caplog
):
    """A new tiny-VAE checkpoint (yamls/tiny-vae.yaml) carries a record of family "vae" and preset
    tiny-vae, so models.export and models.generate say in one line that it is a VAE alone, not that
    it was "written before checkpoints carried one"; so do ones saved before autoencoder runs
    recorded theirs (found by their tensors)."""
    from models import export, generate
    from models.autoencoder import build_autoencoder
    from recipes import build_trainer, load_config
    from tests.conftest import REPO

    overrides = [
        f"data.train.local={shapes_mds / 'mds'}",
        "~data.train.prepare",
        "global_train_batch_size=16",
        "trainer.max_duration=1ba",
        f"trainer.save_folder={tmp_path / 'ckpt'}",
        "trainer.progress_bar=false",
        f"callbacks.save_pretrained.folder={tmp_path / 'export'}",
    ]
    trainer = build_trainer(load_config(REPO / "yamls/tiny-vae.yaml", overrides))
    trainer.fit()
    trainer.close()
    (checkpoint,) = (path for path in (tmp_path / "ckpt").glob("*.pt") if not path.is_symlink())
    full = torch.load(checkpoint, weights_only=False)
    record = read_record(full["state"])
    assert (record["family"], record["preset"], record["version"]) == ("vae", "tiny-vae", 1)
    assert record["vae"] == describe(build_autoencoder("tiny"))["vae"]  # the tiny preset's VAE config

    del full["state"]["callbacks"]["ModelRecord"]  # as an autoencoder run saved it before
    torch.save(full, tmp_path / "old-vae.pt")
    for path, named in ((checkpoint, "tiny-vae"), (tmp_path / "old-vae.pt", "a -vae preset")):
        line = f"is a checkpoint of an autoencoder run ({named}): a VAE alone, with no denoiser"
        with caplog.at_level(logging.WARNING), pytest.raises(SystemExit, match=re.escape(line)):
            export.main([str(path), str(tmp_path / "pipeline")])
        with pytest.raises(SystemExit, match=re.escape(line)):
            generate.main([str(path), "a red circle", "--out", str(tmp_path / "grid.png")])
    assert "has no model record" not in caplog.text
    assert not (tmp_path / "pipeline").exists() and not (tmp_path / "grid.png").exists()


def test_an_autoencoder_is_described_by_its_preset_and_vae():
    from models.autoencoder import build_autoencoder

    record = describe(build_autoencoder("tiny"))
    assert record == {
        "version": 1, "family": "vae", "preset": "tiny-vae", "vae": record["vae"]
    }  # fmt: skip
    vae = PRESETS["tiny"]["vae"]
    assert record["vae"]["latent_channels"] == vae["latent_channels"] == 4
    assert record["vae"]["block_out_channels"] == list(vae["block_out_channels"])
