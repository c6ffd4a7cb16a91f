"""models.generate: PNG grids from a checkpoint and from an exported pipeline folder."""

import logging
import runpy
import sys

import numpy as np
import pytest
from PIL import Image

from models import generate
from models.export import export_pipeline, load_model_from_checkpoint

PROMPTS = ["a red circle", "a blue square"]
FAST = ["--n-per-prompt", "3", "--steps", "3", "--seed", "5"]


def _grid_size(rows: int, cols: int, side: int, pad: int = generate.GRID_PADDING) -> tuple[int, int]:
    return cols * (side + pad) + pad, rows * (side + pad) + pad  # PIL sizes are (width, height)


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoint):
    return tiny_checkpoint


@pytest.fixture(scope="module")
def exported(checkpoint, tmp_path_factory):
    return export_pipeline(load_model_from_checkpoint(checkpoint), tmp_path_factory.mktemp("pipe") / "p")


@pytest.mark.filterwarnings("ignore:.*found in sys.modules:RuntimeWarning")  # runpy, harmless
def test_grid_from_checkpoint_and_from_folder_match(checkpoint, exported, tmp_path, monkeypatch):
    from_ckpt, from_dir = tmp_path / "ckpt.png", tmp_path / "dir.png"
    generate.main([str(checkpoint), *PROMPTS, "--out", str(from_ckpt), *FAST])
    # The folder through the module's real entry point (`python -m models.generate ...`), in-process.
    monkeypatch.setattr(
        sys, "argv", ["models.generate", str(exported), *PROMPTS, "--out", str(from_dir), *FAST]
    )
    runpy.run_module("models.generate", run_name="__main__", alter_sys=True)
    a, b = Image.open(from_ckpt), Image.open(from_dir)
    assert a.format == b.format == "PNG"
    assert a.size == b.size == _grid_size(rows=2, cols=3, side=32)
    # Both hold the EMA UNet and sample with DDIM from the same seed: the same picture.
    assert np.array_equal(np.asarray(a), np.asarray(b))


def test_rows_share_noise_and_options_apply(exported, tmp_path):
    model = generate.load_model(exported)
    kwargs = dict(num_inference_steps=2, sampler="euler", height=64, width=64, guidance_scale=3.0)
    grid = generate.sample_grid(model, PROMPTS, 2, seed=1, **kwargs)
    assert grid.shape == (4, 3, 64, 64)
    # A prompt's row does not depend on the other prompts on the grid.
    alone = generate.sample_grid(model, PROMPTS[1:], 2, seed=1, **kwargs)
    assert (grid[2:] - alone).abs().max() < 1e-5
    out = tmp_path / "sub" / "g.png"
    generate.main([str(exported), "x", "--out", str(out), "--n-per-prompt", "2", "--steps", "2"])
    assert Image.open(out).size == _grid_size(rows=1, cols=2, side=32)


def test_clear_errors(checkpoint, exported, tmp_path):
    with pytest.raises(ValueError, match="already holds the weights"):
        generate.load_model(exported, ema=True)
    with pytest.raises(FileNotFoundError, match="no checkpoint or pipeline folder at .*missing.pt"):
        generate.load_model(tmp_path / "missing.pt")
    with pytest.raises(FileNotFoundError, match="no model_index.json"):
        generate.load_model(tmp_path)


def test_a_prompt_longer_than_the_text_encoder_reads_is_said(checkpoint, tmp_path, caplog):
    long = "a red circle " + "on a very long and winding road " * 12
    with caplog.at_level(logging.WARNING, logger="models.generate"):
        generate.main([str(checkpoint), "a red circle", long, "--out", str(tmp_path / "g.png"),
                       "--n-per-prompt", "1", "--steps", "1", "--device", "cpu"])  # fmt: skip
    lines = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]  # ours alone
    count = len(generate.load_model(checkpoint).tokenizer(long, verbose=False)["input_ids"])
    assert lines == [
        f"the prompt 'a red circle on a very ...' is {count} tokens for CLIPTokenizer, whose text encoder "
        f"reads 77: the last {count - 77} are cut"
    ]
