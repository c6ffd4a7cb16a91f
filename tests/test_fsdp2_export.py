"""Export, generate and the load check read a sharded checkpoint (a folder written by 2 ranks under
FSDP2) on one process, knowing nothing of the ranks that wrote it (models/checkpoints/sharded_checkpoint.py).

The same weights as one checkpoint file, made by torch's own converter (`dcp_to_torch_save`, which
shares no code with ours), export to the same pipeline, which samples the same image."""

import shutil

import pytest
import torch
from diffusers import StableDiffusion3Pipeline
from safetensors.torch import load_file
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from models import build_model, export, generate
from models.checkpoints.checkpoint_file import CheckpointError, check_checkpoint_file
from models.export import load_model_from_checkpoint
from recipes.load_check import load_path_problem
from tests.fsdp2_runs import BATCHES

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def sharded_and_file(mmdit_reference, tmp_path_factory):
    """The shard-2 run's last checkpoint (a folder) and the same checkpoint converted to one file."""
    folder = mmdit_reference("shard-2") / "ckpt" / f"ep1-ba{BATCHES}"
    file = tmp_path_factory.mktemp("converted") / "ckpt.pt"
    dcp_to_torch_save(folder, file)
    return folder, file


def test_export_of_a_sharded_checkpoint_samples_as_the_unsharded_file(sharded_and_file, tmp_path):
    folder, file = sharded_and_file
    images = {}
    for name, checkpoint in (("sharded", folder), ("file", file)):
        export.main([str(checkpoint), str(tmp_path / name)])
        pipe = StableDiffusion3Pipeline.from_pretrained(
            tmp_path / name, local_files_only=True, text_encoder_3=None, tokenizer_3=None
        )
        pipe.set_progress_bar_config(disable=True)
        images[name] = pipe(
            ["a red circle"],
            generator=torch.Generator().manual_seed(0),
            num_inference_steps=3,
            guidance_scale=4.0,
            max_sequence_length=8,
            output_type="pt",
        ).images
    weights = [load_file(tmp_path / n / "transformer/diffusion_pytorch_model.safetensors") for n in images]
    assert weights[0].keys() == weights[1].keys()
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])
    assert torch.equal(images["sharded"], images["file"])
    assert images["sharded"].std() > 0.01  # an image, not a blank

    # The EMA average by default (the run had one), and it is not the raw weights.
    ema = load_model_from_checkpoint(folder, ema=True).transformer.state_dict()
    raw = load_model_from_checkpoint(folder, ema=False).transformer.state_dict()
    assert any(not torch.equal(ema[k], raw[k]) for k in ema)
    assert all(torch.equal(ema[k], weights[0][k]) for k in weights[0])


def test_generate_and_the_load_check_read_it(sharded_and_file, tmp_path):
    folder, _ = sharded_and_file
    out = tmp_path / "g.png"
    generate.main([str(folder), "a red circle", "--steps", "2", "--n-per-prompt", "1", "--out", str(out)])
    assert out.stat().st_size > 0
    assert load_path_problem(str(folder), build_model("mmdit-tiny"), "mmdit-tiny") is None
    problem = load_path_problem(str(folder), build_model("tiny"), "tiny")
    assert problem.startswith(f"trainer.load_path: {folder} holds a model of preset mmdit-tiny")


def test_an_incomplete_sharded_checkpoint_is_one_line(sharded_and_file, tmp_path):
    folder, _ = sharded_and_file
    torn = tmp_path / "ep0-ba3"
    shutil.copytree(folder, torn)
    (torn / "__1_0.distcp").unlink()
    with pytest.raises(
        CheckpointError, match=r"ep0-ba3 is an incomplete sharded checkpoint: __1_0.distcp is missing"
    ):
        check_checkpoint_file(torn)
    with pytest.raises(SystemExit, match="python -m models.export: error: .* incomplete sharded checkpoint"):
        export.main([str(torn), str(tmp_path / "out")])
    assert not (tmp_path / "out").exists()
