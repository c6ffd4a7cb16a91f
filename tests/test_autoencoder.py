"""The autoencoder recipe (yamls/tiny-vae.yaml): it trains, exports, and becomes SD's frozen VAE."""

import pytest
import torch

from models import build, build_model
from recipes import ConfigError, build_trainer, load_config, parse_config
from tests.conftest import REPO

VAE_YAML = REPO / "yamls/tiny-vae.yaml"


@pytest.mark.fit
def test_vae_recipe_trains_and_its_export_is_the_diffusion_models_vae(shapes_mds, tmp_path):
    export = tmp_path / "export"
    overrides = [
        f"data.train.local={shapes_mds / 'mds'}",
        "~data.train.prepare",
        "global_train_batch_size=16",
        "trainer.max_duration=12ba",
        f"trainer.save_folder={tmp_path / 'ckpt'}",
        "trainer.progress_bar=false",
        f"callbacks.save_pretrained.folder={export}",
    ]
    trainer = build_trainer(load_config(VAE_YAML, overrides))
    autoencoder = trainer.state.model
    batch = next(iter(trainer.state.train_dataloader))
    with torch.no_grad():
        before = autoencoder.loss(autoencoder(batch), batch).item()
    trainer.fit()
    autoencoder.eval()
    with torch.no_grad():
        after = autoencoder.loss(autoencoder(batch), batch).item()
    assert after < 0.7 * before  # reconstruction error falls within a dozen batches
    assert autoencoder.latent_var.item() != 1.0  # tracked from the sampled latents

    sd = build_model("tiny", pretrained=str(export), pretrained_components=["vae"])
    trained = autoencoder.vae.state_dict()
    assert all(torch.equal(v, trained[k]) for k, v in sd.vae.state_dict().items())
    expected_scale = autoencoder.latent_var.rsqrt().item()
    assert sd.latent_scale.item() == pytest.approx(expected_scale, rel=1e-6)
    # the scale is a buffer, so it travels in checkpoints with the weights
    assert sd.state_dict()["latent_scale"].item() == pytest.approx(expected_scale, rel=1e-6)


def test_autoencoder_options_are_checked_against_its_own_builder():
    run = parse_config(load_config(VAE_YAML))
    assert run.model == {"preset": "tiny-vae", "kl_weight": 1e-6}
    with pytest.raises(ConfigError, match="model.prediction_type"):
        parse_config(load_config(VAE_YAML, ["+model.prediction_type=v_prediction"]))
    with pytest.raises(ConfigError, match="'model.preset' must be one of"):
        parse_config(load_config(VAE_YAML, ["model.preset=huge-vae"]))
    with pytest.raises(ValueError, match="kl_weight"):
        build("tiny-vae", kl_weight=-1)


def test_missing_vae_folder_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="no-such-vae"):
        build_model("tiny", pretrained=str(tmp_path / "no-such-vae"), pretrained_components=["vae"])


@pytest.mark.fit
@pytest.mark.subprocess
def test_tiny_recipe_makes_its_missing_vae_first(shapes_mds, tmp_path):
    """yamls/tiny-cpu.yaml on a fresh checkout: `prepare_pretrained` runs the VAE recipe once."""
    for name in ("_base.yaml", "tiny-vae.yaml"):
        (tmp_path / name).write_text((REPO / "yamls" / name).read_text())
    export = tmp_path / "vae-export"
    (tmp_path / "short-vae.yaml").write_text(
        "defaults:\n  - tiny-vae\n  - _self_\n"
        f"data: {{train: {{local: {shapes_mds / 'mds'}, prepare: null}}}}\n"
        f"callbacks: {{save_pretrained: {{folder: {export}}}}}\n"
        f"trainer: {{max_duration: 3ba, save_folder: {tmp_path / 'vae-ckpt'}, progress_bar: false}}\n"
    )
    overrides = [
        f"data.train.local={shapes_mds / 'mds'}",
        "~data.train.prepare",
        "global_train_batch_size=16",
        f"model.pretrained={export}",
        f"prepare_pretrained={tmp_path / 'short-vae.yaml'}",
        "trainer.max_duration=1ba",
        "callbacks.samples=null",
        f"trainer.save_folder={tmp_path / 'sd-ckpt'}",
        "trainer.progress_bar=false",
    ]
    trainer = build_trainer(load_config(REPO / "yamls/tiny-cpu.yaml", overrides))
    assert (export / "vae/config.json").is_file() and not list(tmp_path.glob("vae-export.*"))
    made = (export / "vae/config.json").stat().st_mtime_ns
    trainer.fit()
    trainer.close()
    build_trainer(load_config(REPO / "yamls/tiny-cpu.yaml", overrides)).close()
    assert (export / "vae/config.json").stat().st_mtime_ns == made  # there already: not made again

    bad = [
        *overrides[:3],
        f"model.pretrained={tmp_path / 'other'}",
        f"prepare_pretrained={tmp_path / 'nope.yaml'}",
    ]
    with pytest.raises(ConfigError, match="no recipe at .*nope.yaml"):
        build_trainer(load_config(REPO / "yamls/tiny-cpu.yaml", bad))


def test_save_pretrained_rejects_a_model_it_cannot_export_before_training():
    from types import SimpleNamespace

    from extensions.save_pretrained import SavePretrained

    state = SimpleNamespace(model=build_model("tiny"))  # StableDiffusion: export it with models.export
    with pytest.raises(TypeError, match="StableDiffusion has no save_pretrained"):
        SavePretrained("unused").fit_start(state, logger=None)


def test_prepare_pretrained_finds_a_repo_recipe_from_another_folder(tmp_path, monkeypatch):
    import subprocess
    from types import SimpleNamespace

    from recipes.prepare import prepare_pretrained

    ran = []

    def fake_run(cmd, env):  # stands in for the minute-long VAE recipe: records it, writes the folder
        ran.append(cmd)
        (tmp_path / "runs/tiny-vae/export").mkdir(parents=True)
        return SimpleNamespace(returncode=0)

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(subprocess, "run", fake_run)
    # A folder the recipe does not write (a typo) is not "made" by running it over its own export.
    with pytest.raises(ConfigError, match="model.pretrained=runs/tiny-vae/exprot does not exist"):
        prepare_pretrained("runs/tiny-vae/exprot", "yamls/tiny-vae.yaml")
    assert ran == []
    prepare_pretrained("runs/tiny-vae/export", "yamls/tiny-vae.yaml")
    assert ran and ran[0][-1] == str(REPO / "yamls/tiny-vae.yaml")
    with pytest.raises(ConfigError, match="no recipe at yamls/nope.yaml"):
        prepare_pretrained(str(tmp_path / "other"), "yamls/nope.yaml")
