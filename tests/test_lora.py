"""yamls/sd2-lora.yaml: only a peft adapter trains; checkpoints hold only it and resume bitwise; the
export is diffusers' LoRA file (or a merged pipeline) that samples like our model."""

import pytest
import torch
from diffusers import DDIMScheduler, StableDiffusionPipeline

from extensions.ema import find_ema
from models.export import load_model_from_checkpoint
from models.export import main as export
from recipes import build_trainer, load_config
from tests.conftest import REPO

PROMPTS = ["a red circle", "a blue square"]
SAMPLING = dict(guidance_scale=4.0, num_inference_steps=4, seed=5)


def _trainer(folder, shapes_mds, save, batches, *extra):
    overrides = [
        f"model.pretrained={folder}",
        "model.preset=tiny",
        "model.lora.rank=4",
        "model.lora.alpha=8",
        f"data.train.local={shapes_mds / 'mds'}",
        "data.train.resolution=32",
        "data.train.num_workers=0",
        "global_train_batch_size=8",
        "trainer.device=cpu",
        "trainer.precision=fp32",
        f"trainer.max_duration={batches}ba",
        "scheduler.t_warmup=0ba",
        "optimizer.lr=1.0e-2",  # a few batches must move the adapter visibly
        "algorithms.ema.half_life=2ba",
        f"trainer.save_folder={save}",
        "trainer.save_interval=2ba",
        "trainer.progress_bar=false",
        "callbacks.samples=null",
        *extra,
    ]
    return build_trainer(load_config(REPO / "yamls/sd2-lora.yaml", overrides))


def _adapter(model) -> dict:
    return {k: v.detach().clone() for k, v in model.named_parameters() if v.requires_grad}


@pytest.fixture(scope="module")
def lora_run(tiny_pipeline, shapes_mds, tmp_path_factory):
    """Four batches in one go, and two then a resumed two (autoresume from the batch-2 checkpoint)."""
    folder, _ = tiny_pipeline
    straight = tmp_path_factory.mktemp("lora-straight")
    trainer = _trainer(folder, shapes_mds, straight, 4)
    trainer.fit()
    trainer.close()
    resumed = tmp_path_factory.mktemp("lora-resumed")
    first = _trainer(folder, shapes_mds, resumed, 2)
    first.fit()
    first.close()
    second = _trainer(folder, shapes_mds, resumed, 4, "trainer.autoresume=true")
    assert int(second.state.timestamp.batch) == 2
    second.fit()
    second.close()
    return trainer, second, straight / "ep0-ba4-rank0.pt"


def test_only_the_adapter_trains_and_is_checkpointed(lora_run, tiny_pipeline):
    trainer, _, checkpoint = lora_run
    model = trainer.state.model
    adapter = _adapter(model)
    assert adapter and all(".lora_A." in k or ".lora_B." in k for k in adapter)
    optimized = {id(p) for group in trainer.state.optimizers[0].param_groups for p in group["params"]}
    assert optimized == {id(p) for p in model.parameters() if p.requires_grad}
    assert set(find_ema(trainer.state.algorithms).averaged_state()) == set(adapter)
    _, original = tiny_pipeline
    base = {k: v for k, v in model.unet.state_dict().items() if "lora_" not in k}
    assert all(torch.equal(v, original["unet"][k.replace(".base_layer", "")]) for k, v in base.items())
    saved = torch.load(checkpoint, weights_only=False)["state"]
    assert set(saved["model"]) == set(adapter) | {"latent_scale"}  # no frozen network in the file
    assert any(v.abs().sum() > 0 for k, v in adapter.items() if ".lora_B." in k)  # B starts at 0


def test_a_resumed_lora_run_ends_bitwise_like_the_uninterrupted_one(lora_run):
    trainer, resumed, _ = lora_run
    a, b = _adapter(trainer.state.model), _adapter(resumed.state.model)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    ema_a = find_ema(trainer.state.algorithms).averaged_state()
    ema_b = find_ema(resumed.state.algorithms).averaged_state()
    assert all(torch.equal(ema_a[k], ema_b[k]) for k in ema_a)


def test_diffusers_loads_the_lora_file_and_samples_like_generate(lora_run, tiny_pipeline, tmp_path):
    _, _, checkpoint = lora_run
    folder, _ = tiny_pipeline
    export([str(checkpoint), str(tmp_path / "lora"), "--lora"])
    expected = load_model_from_checkpoint(checkpoint).generate(PROMPTS, **SAMPLING)  # EMA adapter
    pipe = StableDiffusionPipeline.from_pretrained(folder, local_files_only=True)
    pipe.scheduler = DDIMScheduler.from_config(pipe.scheduler.config)  # generate()'s default sampler
    pipe.set_progress_bar_config(disable=True)
    latents = torch.randn((2, 4, 8, 8), generator=torch.Generator().manual_seed(5))
    call = dict(latents=latents, guidance_scale=4.0, num_inference_steps=4, output_type="pt")
    base = pipe(PROMPTS, **call).images
    # The file name is diffusers' default; offline (HF_HUB_OFFLINE, as the tests run) it must be given.
    pipe.load_lora_weights(tmp_path / "lora", weight_name="pytorch_lora_weights.safetensors")
    adapted = pipe(PROMPTS, **call).images
    torch.testing.assert_close(adapted, expected, atol=1e-6, rtol=0)
    assert not torch.allclose(adapted, base, atol=1e-3)  # the adapter changes the images

    export([str(checkpoint), str(tmp_path / "merged"), "--merge-lora"])
    merged = StableDiffusionPipeline.from_pretrained(tmp_path / "merged", local_files_only=True)
    merged.set_progress_bar_config(disable=True)
    assert not any("lora" in k for k in merged.unet.state_dict())
    torch.testing.assert_close(merged(PROMPTS, **call).images, expected, atol=1e-4, rtol=0)


def test_lora_options_are_checked(tiny_pipeline, lora_run):
    from models import build_model

    with pytest.raises(ValueError, match="model.lora: unknown keys \\['rnak'\\]"):
        build_model("tiny", pretrained=str(tiny_pipeline[0]), lora={"rnak": 4})
    with pytest.raises(ValueError, match="set model.pretrained"):
        build_model("tiny", lora={"rank": 4})
    with pytest.raises(SystemExit, match="is a LoRA checkpoint: --lora writes"):  # one line, no traceback
        export([str(lora_run[2]), "/nonexistent-out"])
