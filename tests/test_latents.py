"""`convert latents` output, read back and trained on."""

import numpy as np
import pytest
import torch

from convert.latents import _pixels, columns, iter_samples
from convert.mds import write_mds
from data.latent_dataset import LatentsDataset
from data.streaming_base import StreamingBase
from models import build_model
from models.tokenizer import tokenize
from recipes import build_trainer, load_config
from tests.conftest import REPO, TINY_TEST


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
