"""`convert latents` output, read back and trained on."""

import shutil

import numpy as np
import pytest
import torch

from convert.latents import _pixels, columns, iter_samples
from convert.mds import write_mds
from data.latent_dataset import LatentsDataset
from data.streaming_base import StreamingBase
from models import build_model
from models.engine.tokenizer import tokenize
from recipes import build_trainer, load_config
from tests.conftest import REPO, TINY_TEST
from tests.convert_fixtures import read_mds


@pytest.mark.fit
def test_latents_round_trip_and_training(shapes_mds, tmp_path):
    model = build_model("tiny")
    out = tmp_path / "latents"
    report = write_mds(
        iter_samples(str(shapes_mds / "mds"), model, [16, 32], batch_size=8), str(out), columns([16, 32])
    )
    assert report["samples_written"] == 64

    source = StreamingBase(local=str(shapes_mds / "mds"), shuffle=False, batch_size=1)
    written = StreamingBase(local=str(out), shuffle=False, batch_size=1)
    row, src = written[5], source[5]
    assert (row["caption"], row["key"]) == (src["caption"], src["key"])
    assert row["latents_32"].dtype == np.float16 and row["latents_32"].shape == (8, 8, 8)  # mean + logvar
    assert row["latents_16"].shape == (8, 4, 4)
    expected = model.vae_moments(_pixels(src["image"], 32)[None])[0].half().numpy()
    np.testing.assert_allclose(row["latents_32"], expected, rtol=1e-2, atol=1e-3)
    text = model.encode_text(tokenize(model.tokenizer, [src["caption"]]))[0].half().numpy()
    np.testing.assert_allclose(row["text_embeds"], text, rtol=1e-2, atol=1e-3)

    sample = LatentsDataset(resolution=32, local=str(out), shuffle=False, batch_size=1)[5]
    assert sample["latents"].dtype == torch.float32 and sample["text_embeds"].shape == (77, 32)

    trainer = build_trainer(
        load_config(
            REPO / "yamls/tiny-cpu.yaml",
            [
                f"data.train.local={out}",
                "~data.train.prepare",
                *TINY_TEST,
                "data.train.latents=true",
                "trainer.max_duration=2ba",
                f"trainer.save_folder={tmp_path / 'ckpt'}",
                "trainer.progress_bar=false",
            ],
        )
    )
    trainer.fit()
    assert int(trainer.state.timestamp.batch) == 2


def test_latents_cli(shapes_mds, tmp_path, capsys):
    from convert.__main__ import main

    out = tmp_path / "cli"
    argv = ["latents", "--src", str(shapes_mds / "mds"), "--out", str(out), "--resolutions", "16"]
    assert main([*argv, "--preset", "tiny", "--batch-size", "32"]) == 0
    assert "1/1 inputs done (1 this run); 64 samples written" in capsys.readouterr().out
    row = StreamingBase(local=str(out), shuffle=False, batch_size=1)[0]
    assert row["latents_16"].shape == (8, 4, 4) and row["text_embeds"].shape == (77, 32)

    assert main(["latents", "--src", str(tmp_path), "--out", str(tmp_path / "x"), "--resolutions", "16"]) == 1
    assert "not an MDS dataset" in capsys.readouterr().err


@pytest.mark.heavy
def test_latents_of_a_vae_only_export_with_its_recipe_are_the_demos(shapes_mds, tmp_path, capsys):
    """`sd-convert latents --recipe yamls/tiny-cpu.yaml` over a VAE-only export (what yamls/tiny-vae.yaml
    writes: vae/ alone) encodes with that VAE and the random text encoder the recipe's training run
    draws after its seed: the same latents and text embeddings as the demo's precompute_latents,
    bitwise, at the recipe's seed and at another; --pretrained of such a folder is one line naming
    --recipe."""
    from convert.__main__ import main
    from demo.run import precompute_latents
    from models.autoencoder import build_autoencoder

    torch.manual_seed(1)
    build_autoencoder("tiny").save_pretrained(tmp_path / "vae")  # runs/tiny-vae/export's layout
    shutil.copytree(shapes_mds / "mds", tmp_path / "shapes")  # the demo writes beside its source
    recipe = str(REPO / "yamls/tiny-cpu.yaml")
    src = ["--src", str(tmp_path / "shapes"), "--resolutions", "32", "--no-progress"]
    for seed in (17, 3):  # 17: the recipe's own
        model = [f"model.pretrained={tmp_path / 'vae'}", f"seed={seed}"]
        demo = load_config(recipe, [*model, f"data.train.local={tmp_path / 'shapes'}"])
        demo_set = precompute_latents(demo)[0][1].removeprefix("data.train.local=")
        out = tmp_path / f"cli-{seed}"
        assert main(["latents", *src, "--out", str(out), "--recipe", recipe, *model]) == 0
        expected, got = read_mds(demo_set), read_mds(out)
        assert [r["key"] for r in got] == [r["key"] for r in expected] and len(got) == 64
        for row, want in zip(got, expected, strict=True):
            assert np.array_equal(row["latents_32"], want["latents_32"])
            assert np.array_equal(row["text_embeds"], want["text_embeds"])
        shutil.rmtree(demo_set)
        if seed == 17:
            recipe_17 = got[0]["text_embeds"]
    assert not np.array_equal(got[0]["text_embeds"], recipe_17)  # another seed, another text encoder
    capsys.readouterr()
    vae_only = ["--preset", "tiny", "--pretrained", str(tmp_path / "vae")]
    assert main(["latents", *src, "--out", str(tmp_path / "x"), *vae_only]) == 1
    assert "has no text_encoder/, tokenizer/ (a VAE-only export" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--recipe", "yamls/tiny-cpu.yaml", "--preset", "tiny"], "--recipe gives the model: drop --preset"),
        (["seed=3"], "seed=3: KEY=VALUE overrides apply to a --recipe; give one"),
        (["--recipe", "yamls/tiny-vae.yaml"], "its model.preset is tiny-vae, a VAE alone (no text encoder)"),
        (["--recipe", "yamls/tiny-cpu.yaml", "model.pretrained=nope"], "--recipe: model.pretrained=nope"),
        (["--recipe", "yamls/tiny-cpu.yaml", "sed=3"], "yamls/tiny-cpu.yaml: unknown config key 'sed' here"),
    ],
)
def test_recipe_mistakes_are_one_line_before_anything_is_written(
    shapes_mds, tmp_path, capsys, flags, message
):
    from convert.__main__ import main

    argv = ["latents", "--src", str(shapes_mds / "mds"), "--out", str(tmp_path / "out")]
    argv += ["--resolutions", "32"]  # an override after it is the recipe's, not a resolution
    try:
        code = main([*argv, *flags])
    except SystemExit as exit_:  # argparse's usage error
        code = exit_.code
    assert code in (1, 2)
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()
