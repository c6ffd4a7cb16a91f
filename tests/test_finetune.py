"""yamls/sd2-finetune.yaml from a diffusers pipeline folder: every component is the folder's, only
the UNet trains, and the export loads in diffusers."""

import pytest
import torch
from diffusers import StableDiffusionPipeline

from recipes import build_trainer, load_config
from tests.conftest import REPO


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.fit
def test_finetune_starts_from_the_folder_and_trains_only_the_unet(tiny_pipeline, shapes_mds, tmp_path):
    folder, original = tiny_pipeline
    overrides = [
        f"model.pretrained={folder}",
        "model.preset=tiny",
        f"data.train.local={shapes_mds / 'mds'}",
        "data.train.resolution=32",
        "data.train.num_workers=0",
        "global_train_batch_size=8",
        "trainer.device=cpu",
        "trainer.precision=fp32",
        "trainer.max_duration=2ba",
        "scheduler.t_warmup=0ba",  # the recipe warms up over 100 batches: 2 would barely move
        f"trainer.save_folder={tmp_path}",
        "trainer.save_filename=ckpt.pt",
        "trainer.progress_bar=false",
        "callbacks.samples=null",
    ]
    trainer = build_trainer(load_config(REPO / "yamls/sd2-finetune.yaml", overrides))
    model = trainer.state.model
    assert model.prediction_type == "v_prediction"  # from the folder's scheduler
    for name in ("unet", "vae", "text_encoder"):  # the folder's weights, not the preset's random ones
        assert _same(getattr(model, name).state_dict(), original[name]), name
    trainer.fit()
    trainer.close()
    assert not _same(model.unet.state_dict(), original["unet"])
    assert _same(model.vae.state_dict(), original["vae"])
    assert _same(model.text_encoder.state_dict(), original["text_encoder"])

    from models.export import main as export

    export([str(tmp_path / "ckpt.pt"), str(tmp_path / "export")])  # no flags: the checkpoint's record
    pipe = StableDiffusionPipeline.from_pretrained(tmp_path / "export", local_files_only=True)
    assert pipe.scheduler.config.prediction_type == "v_prediction"
    ema = trainer.state.algorithms[0].averaged_state()
    exported = pipe.unet.state_dict()
    assert all(torch.equal(exported[k.removeprefix("unet.")], v) for k, v in ema.items())
