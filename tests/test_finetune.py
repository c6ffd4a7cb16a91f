"""yamls/sd2-finetune.yaml from a diffusers pipeline folder: every component is the folder's, only
the UNet trains, and the export loads in diffusers."""

import pytest
import torch
from diffusers import DDPMScheduler, StableDiffusionPipeline

from models import build_model
from recipes import build_trainer, load_config
from tests.conftest import REPO


@pytest.fixture(scope="module")
def pipeline_folder(tmp_path_factory):
    """A small SD pipeline written with diffusers' own save_pretrained (random tiny weights, a
    v-prediction schedule, so the objective visibly comes from the folder)."""
    torch.manual_seed(1)
    model = build_model("tiny")
    pipe = StableDiffusionPipeline(
        vae=model.vae,
        text_encoder=model.text_encoder,
        tokenizer=model.tokenizer,
        unet=model.unet,
        scheduler=DDPMScheduler.from_config(model.noise_scheduler.config, prediction_type="v_prediction"),
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    )
    folder = tmp_path_factory.mktemp("pipeline")
    pipe.save_pretrained(folder)
    return folder, {name: getattr(model, name).state_dict() for name in ("unet", "vae", "text_encoder")}


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_finetune_starts_from_the_folder_and_trains_only_the_unet(pipeline_folder, shapes_mds, tmp_path):
    folder, original = pipeline_folder
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
