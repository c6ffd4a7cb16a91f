"""SDXL (issue 25) beyond training: what its checkpoint's record holds, export to a diffusers
StableDiffusionXLPipeline folder that samples like our generate() (negative prompts, the zeros for the
empty prompt), fine-tuning from such a folder, and a LoRA file that StableDiffusionXLPipeline loads.
(The record's round trip and models.generate on an exported folder: tests/test_families.py.)

All on sdxl-tiny with random weights (the round trips are what is tested, not what the model learnt),
32 px, 4 sampling steps."""

import logging

import numpy as np
import pytest
import torch
from diffusers import StableDiffusionXLPipeline

from models import build_model, export
from models.checkpoints.record import describe, read_record
from models.engine.tokenizer import tokenize
from models.export import infer_preset, load_model_from_checkpoint
from models.families.sdxl.model import StableDiffusionXL

PROMPTS = ["a red circle", "a blue square"]
SAMPLING = dict(guidance_scale=4.0, num_inference_steps=4)
NETWORKS = ("unet", "vae", "text_encoder", "text_encoder_2")


def _checkpoint_of(model, path):
    """What a Composer checkpoint holds for export: the weights and the ModelRecord callback's record
    (tests/test_record.py does the same for SD)."""
    state = {"model": model.state_dict(), "callbacks": {"ModelRecord": describe(model)}, "algorithms": []}
    torch.save({"state": state}, path)
    return path


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _pipeline(folder) -> StableDiffusionXLPipeline:
    # add_watermarker=False: with the invisible-watermark package installed the pipeline would mark
    # its images by default.
    pipe = StableDiffusionXLPipeline.from_pretrained(folder, local_files_only=True, add_watermarker=False)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _pipe_images(pipe, seed: int, **kwargs) -> torch.Tensor:
    # generate() draws its noise from a seeded CPU generator; the pipeline scales `latents` by
    # init_noise_sigma itself, as generate() does.
    latents = torch.randn((len(PROMPTS), 4, 8, 8), generator=torch.Generator().manual_seed(seed))
    return pipe(PROMPTS, latents=latents, output_type="pt", **SAMPLING, **kwargs).images


@pytest.fixture(scope="module")
def sdxl(tmp_path_factory):
    """(model, checkpoint, exported folder): a random sdxl-tiny model, its checkpoint with the model
    record, and that checkpoint exported by the CLI without flags."""
    folder = tmp_path_factory.mktemp("sdxl")
    torch.manual_seed(0)
    model = build_model("sdxl-tiny").eval()
    checkpoint = _checkpoint_of(model, folder / "ckpt.pt")
    export.main([str(checkpoint), str(folder / "pipeline")])
    return model, checkpoint, folder / "pipeline"


@pytest.mark.heavy
def test_the_record_holds_what_sdxl_adds(sdxl):
    """Its version, the second text encoder, both tokenizers' paddings, the UNet's added conditioning
    (that the record rebuilds the model: tests/test_families.py)."""
    _, checkpoint, _ = sdxl
    record = read_record(torch.load(checkpoint, weights_only=False)["state"])
    assert record["family"] == "sdxl" and record["version"] == 2 and record["preset"] == "sdxl-tiny"
    assert record["text_encoder_2"]["hidden_size"] == 32 and record["text_encoder_2"]["projection_dim"] == 32
    assert record["tokenizer"]["pad_token"] == "<|endoftext|>" and record["tokenizer_2"]["pad_token"] == "!"
    assert record["unet"]["addition_embed_type"] == "text_time"


def test_an_sd_record_stays_version_1():
    record = describe(build_model("tiny"))
    assert record["version"] == 1 and record["family"] == "sd" and "text_encoder_2" not in record


@pytest.mark.heavy
def test_pipeline_samples_like_generate(sdxl):
    model, _, folder = sdxl
    pipe = _pipeline(folder)
    assert type(pipe.scheduler).__name__ == "DDIMScheduler"
    assert pipe.config.force_zeros_for_empty_prompt is True
    assert pipe.vae.config.scaling_factor == pytest.approx(0.13025)
    expected = model.generate(PROMPTS, seed=3, sampler="ddim", **SAMPLING)
    images = _pipe_images(pipe, seed=3)
    assert images.shape == expected.shape == (2, 3, 32, 32)
    torch.testing.assert_close(images, expected, atol=1e-6, rtol=0)
    # With a negative prompt both encode it with both encoders (no zeros).
    negative = model.generate(PROMPTS, negative_prompt="green", seed=3, **SAMPLING)
    assert not torch.allclose(negative, expected, atol=1e-4)
    torch.testing.assert_close(
        _pipe_images(pipe, seed=3, negative_prompt="green"), negative, atol=1e-6, rtol=0
    )


@pytest.mark.heavy
def test_an_unrecorded_sdxl_checkpoint_is_inferred_from_its_shapes(sdxl, tmp_path, caplog):
    model, checkpoint, _ = sdxl
    full = torch.load(checkpoint, weights_only=False)
    del full["state"]["callbacks"]
    torch.save(full, tmp_path / "old.pt")
    with caplog.at_level(logging.WARNING):
        loaded = load_model_from_checkpoint(tmp_path / "old.pt")
    assert "has no model record" in caplog.text
    assert type(loaded) is StableDiffusionXL and loaded.preset == "sdxl-tiny"
    assert loaded.tokenizer.pad_token == "<|endoftext|>" and loaded.tokenizer_2.pad_token == "!"
    assert _same(loaded.state_dict(), model.state_dict())
    with pytest.raises(ValueError, match="does not hold preset 'tiny'"):
        load_model_from_checkpoint(tmp_path / "old.pt", preset="tiny")


def test_inference_builds_only_the_presets_of_the_weights_family(monkeypatch):
    """SD weights never build an SDXL preset's shapes (sdxl-base's are 3.4 B parameters), nor SDXL
    weights an SD preset's."""
    built = []
    shapes = export._preset_shapes

    def recording(preset):
        built.append(preset)
        return shapes(preset)

    monkeypatch.setattr(export, "_preset_shapes", recording)
    sd = {k: torch.empty(s, device="meta") for k, s in shapes("tiny").items()}
    assert infer_preset(sd) == "tiny" and not any(p.startswith("sdxl") for p in built)
    built.clear()
    xl = {k: torch.empty(s, device="meta") for k, s in shapes("sdxl-tiny").items()}
    assert infer_preset(xl) == "sdxl-tiny" and all(p.startswith("sdxl") for p in built)


def test_sdxl_base_is_inferred_from_its_shapes():
    shapes = export._preset_shapes("sdxl-base")  # meta-device shapes (about 1 s): no 14 GB of weights
    weights = {k: torch.empty(shape, device="meta") for k, shape in shapes.items()}
    assert infer_preset(weights) == "sdxl-base"


@pytest.mark.heavy
def test_finetuning_loads_every_part_of_an_sdxl_folder(sdxl):
    model, _, folder = sdxl
    torch.manual_seed(1)  # the preset's random init would differ from the folder's weights
    loaded = build_model(
        "sdxl-tiny",
        pretrained=str(folder),
        pretrained_components=["unet", "vae", "text_encoder", "tokenizer"],
    )
    assert type(loaded) is StableDiffusionXL
    for name in NETWORKS:
        assert _same(getattr(loaded, name).state_dict(), getattr(model, name).state_dict()), name
    assert loaded.pretrained["components"] == [
        "unet",
        "vae",
        "text_encoder",
        "tokenizer",
        "text_encoder_2",
        "tokenizer_2",
    ]
    assert loaded.tokenizer.pad_token == "<|endoftext|>" and loaded.tokenizer_2.pad_token == "!"
    ids = tokenize(model.tokenizer_2, PROMPTS)
    assert torch.equal(tokenize(loaded.tokenizer_2, PROMPTS), ids)
    record = describe(loaded)
    assert record["tokenizer_2"]["source"] == str(folder)


def _batch(model, n: int = 4) -> dict:
    generator = torch.Generator().manual_seed(0)
    captions = [PROMPTS[i % 2] for i in range(n)]
    return {
        "image": torch.rand((n, 3, 32, 32), generator=generator) * 2 - 1,
        "input_ids": tokenize(model.tokenizer, captions),
        "input_ids_2": tokenize(model.tokenizer_2, captions),
        "original_size": torch.tensor([[48, 40]] * n),
        "crop_top_left": torch.tensor([[8, 4]] * n),
    }


@pytest.fixture(scope="module")
def lora(sdxl, tmp_path_factory):
    """A rank-4 adapter on the exported folder's UNet, trained 3 steps, and its checkpoint."""
    _, _, folder = sdxl
    out = tmp_path_factory.mktemp("sdxl-lora")
    torch.manual_seed(0)
    model = build_model("sdxl-tiny", pretrained=str(folder), lora={"rank": 4, "alpha": 8})
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-2)
    batch = _batch(model)
    model.train()
    losses = []
    for _ in range(3):
        loss = model.loss(model(batch), batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss))
    model.eval()
    return model, _checkpoint_of(model, out / "ckpt.pt"), losses


@pytest.mark.heavy
def test_a_lora_adapter_trains_on_the_sdxl_unet(lora):
    model, checkpoint, losses = lora
    adapter = {k for k, p in model.named_parameters() if p.requires_grad}
    assert adapter and all(".lora_A." in k or ".lora_B." in k for k in adapter)
    assert all(k.startswith("unet.") for k in adapter) and np.isfinite(losses).all()
    assert any(p.abs().sum() > 0 for k, p in model.named_parameters() if ".lora_B." in k)  # B starts at 0
    saved = torch.load(checkpoint, weights_only=False)["state"]["model"]
    assert set(saved) == adapter | {"latent_scale"}  # no frozen network, no text_encoder_2


@pytest.mark.heavy
def test_diffusers_loads_the_sdxl_lora_file(sdxl, lora, tmp_path):
    _, _, folder = sdxl
    model, checkpoint, _ = lora
    export.main([str(checkpoint), str(tmp_path / "lora"), "--lora"])
    pipe = _pipeline(folder)
    base = _pipe_images(pipe, seed=5)
    # The file name is diffusers' default; offline (HF_HUB_OFFLINE, as the tests run) it must be given.
    pipe.load_lora_weights(tmp_path / "lora", weight_name="pytorch_lora_weights.safetensors")

    # The UNet outputs: the pipeline's adapted UNet is ours.
    generator = torch.Generator().manual_seed(1)
    latents = torch.randn((2, 4, 8, 8), generator=generator)
    condition = model.condition(_batch(model, 2), False, (32, 32))
    with torch.no_grad():
        ours = model.unet(latents, torch.tensor([500, 20]), **condition).sample
        theirs = pipe.unet(latents, torch.tensor([500, 20]), **condition).sample
    torch.testing.assert_close(theirs, ours, atol=1e-6, rtol=0)

    # And the images: the checkpoint's model (base folder + adapter) samples like the pipeline.
    expected = load_model_from_checkpoint(checkpoint).generate(PROMPTS, seed=5, **SAMPLING)
    adapted = _pipe_images(pipe, seed=5)
    torch.testing.assert_close(adapted, expected, atol=1e-6, rtol=0)
    assert not torch.allclose(adapted, base, atol=1e-4)  # the adapter changes the images

    export.main([str(checkpoint), str(tmp_path / "merged"), "--merge-lora"])
    merged = _pipeline(tmp_path / "merged")
    assert not any("lora" in k for k in merged.unet.state_dict())
    torch.testing.assert_close(_pipe_images(merged, seed=5), expected, atol=1e-4, rtol=0)


@pytest.mark.fit
def test_the_sdxl_lora_recipe_trains_and_exports_what_diffusers_loads(sdxl, shapes_mds, tmp_path):
    """yamls/sdxl-lora.yaml on the exported folder: the data path hands over both tokenizers' ids and
    micro-conditioning, the checkpoint records an SDXL LoRA model, and --lora writes the file."""
    from recipes import build_trainer, load_config
    from tests.conftest import REPO

    _, _, folder = sdxl
    overrides = [
        f"model.pretrained={folder}",
        "model.preset=sdxl-tiny",
        "model.lora.rank=4",
        "model.lora.alpha=8",
        f"data.train.local={shapes_mds / 'mds'}",
        "data.train.resolution=32",
        "data.train.num_workers=0",
        "global_train_batch_size=8",
        "trainer.device=cpu",
        "trainer.precision=fp32",
        "trainer.device_train_microbatch_size=8",
        "trainer.max_duration=2ba",
        "scheduler.t_warmup=0ba",
        "optimizer.lr=1.0e-2",
        f"trainer.save_folder={tmp_path / 'run'}",
        "trainer.save_filename=ckpt.pt",
        "trainer.progress_bar=false",
        "callbacks.samples=null",
    ]
    trainer = build_trainer(load_config(REPO / "yamls/sdxl-lora.yaml", overrides))
    trainer.fit()
    trainer.close()
    checkpoint = tmp_path / "run" / "ckpt.pt"
    record = read_record(torch.load(checkpoint, weights_only=False)["state"])
    assert record["family"] == "sdxl" and record["lora"]["rank"] == 4
    export.main([str(checkpoint), str(tmp_path / "lora"), "--lora"])
    pipe = _pipeline(folder)
    pipe.load_lora_weights(tmp_path / "lora", weight_name="pytorch_lora_weights.safetensors")
    expected = load_model_from_checkpoint(checkpoint).generate(PROMPTS, seed=5, **SAMPLING)
    torch.testing.assert_close(_pipe_images(pipe, seed=5), expected, atol=1e-6, rtol=0)


@pytest.mark.heavy
def test_a_folder_without_zeros_for_the_empty_prompt_keeps_its_unconditional_branch(sdxl, tmp_path):
    """A folder whose pipeline sets force_zeros_for_empty_prompt=false (it guides away from the empty
    prompt's embeddings): fine-tuning from it drops captions to those embeddings, generate() samples
    as that pipeline does, and the record and export keep the flag."""
    model, _, folder = sdxl
    pipe = _pipeline(folder)
    pipe.register_to_config(force_zeros_for_empty_prompt=False)
    pipe.save_pretrained(tmp_path / "no-zeros")
    tuned = build_model(
        "sdxl-tiny",
        pretrained=str(tmp_path / "no-zeros"),
        pretrained_components=["unet", "vae", "text_encoder", "tokenizer"],
        caption_drop_prob=1.0,
    ).train()
    assert tuned.force_zeros_for_empty_prompt is False
    empty_context, empty_pooled = tuned.encode_captions([""], "cpu")
    batch = {
        "image": torch.zeros(2, 3, 32, 32),
        "input_ids": tokenize(tuned.tokenizer, PROMPTS),
        "input_ids_2": tokenize(tuned.tokenizer_2, PROMPTS),
    }
    condition = tuned.condition(batch, True, (32, 32))  # every caption dropped
    assert condition["encoder_hidden_states"].equal(empty_context.expand(2, -1, -1))
    assert condition["added_cond_kwargs"]["text_embeds"].equal(empty_pooled.expand(2, -1))
    tuned.eval()
    expected = tuned.generate(PROMPTS, seed=5, **SAMPLING)
    reference = _pipeline(tmp_path / "no-zeros")
    # 2e-6: on torch 2.14 one value of 6,144 differs by 1.04e-6 (float32 rounding of another op order)
    torch.testing.assert_close(_pipe_images(reference, seed=5), expected, atol=2e-6, rtol=0)
    assert describe(tuned)["force_zeros_for_empty_prompt"] is False
    export.main([str(_checkpoint_of(tuned, tmp_path / "ckpt.pt")), str(tmp_path / "export")])
    assert _pipeline(tmp_path / "export").config.force_zeros_for_empty_prompt is False
    assert load_model_from_checkpoint(tmp_path / "ckpt.pt").force_zeros_for_empty_prompt is False
