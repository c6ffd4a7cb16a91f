"""An mmdit model that reads T5 (issue 38): the `mmdit-tiny-t5` preset (mmdit-tiny with a toy T5 and the
T5 tokenizer built offline, models/engine/tokenizer.py) trains from images, whose data path hands over T5's
ids (`input_ids_3`), and from `sd-convert latents` with the same loss, and its checkpoint exports a
StableDiffusion3Pipeline folder with T5 that samples generate()'s image; sd3-medium with
text_encoder_3 (yamls/sd3-medium.yaml's option) gets T5's ids from its image data path too."""

import json

import pytest
import torch
from diffusers import StableDiffusion3Pipeline
from torch.utils.data import default_collate
from transformers import T5Config, T5EncoderModel, T5TokenizerFast

from convert.encoders import load_encoders
from data.latent_dataset import LatentsDataset
from data.loader import ImageCaptionDataConfig, build_image_caption_dataloader
from models import RectifiedFlowTransformer, build_model, export
from models.build import bundled_tokenizers
from models.checkpoints.record import read_record
from models.components import build_components
from models.engine.tokenizer import T5_VOCAB_SIZE, build_t5_tokenizer, tokenize_t5
from models.export import load_model_from_checkpoint
from models.presets import size_multiple
from models.registry import PRESETS
from recipes import build_trainer, load_config
from recipes.config import parse_config
from recipes.trainer import loader_inputs
from tests.conftest import REPO, tiny_run
from tests.convert_fixtures import read_mds, run_cli

PROMPTS = ["a red circle", "a blue square"]
SAMPLES = 8  # shapes compared one by one


def test_t5_tokenizer_builds_offline_and_round_trips(tmp_path):
    tokenizer = build_t5_tokenizer()
    assert isinstance(tokenizer, T5TokenizerFast)
    assert len(tokenizer) == T5_VOCAB_SIZE == PRESETS["mmdit-tiny-t5"]["text_encoder_3"]["vocab_size"]
    assert (tokenizer.pad_token_id, tokenizer.eos_token_id, tokenizer.unk_token_id) == (0, 1, 2)
    ids = tokenizer("a red circle").input_ids
    assert ids[-1] == 1 and len(ids) == 4  # three whole words, then </s>
    assert tokenizer.decode(ids, skip_special_tokens=True) == "a red circle"
    spelt = tokenizer("a teal circle").input_ids  # a word not in the vocabulary: spelt out
    assert len(spelt) == 4 + len("teal") and tokenizer.unk_token_id not in spelt
    padded = tokenize_t5(tokenizer, PROMPTS + ["a " * 20], 8)
    assert padded.shape == (3, 8) and padded[0, 4:].eq(0).all() and padded[2, -1] == 1  # truncated, </s> kept

    tokenizer.save_pretrained(tmp_path)
    loaded = T5TokenizerFast.from_pretrained(tmp_path, local_files_only=True)
    captions = PROMPTS + ["Ünïcode ＦＵＬＬ width, 42 small triangles"]
    assert torch.equal(tokenize_t5(loaded, captions, 16), tokenize_t5(tokenizer, captions, 16))
    assert len(loaded) == len(tokenizer)


@pytest.mark.heavy
def test_the_preset_builds_its_t5_and_other_presets_stay_without():
    model = build_model("mmdit-tiny-t5")
    assert isinstance(model.text_encoder_3, T5EncoderModel) and not model.text_encoder_3.training
    assert not any(p.requires_grad for p in model.text_encoder_3.parameters())
    context, _ = model.encode_captions(PROMPTS, "cpu")
    assert context.shape == (2, 77 + 8, 128) and not context[:, 77:].eq(0).all()  # T5's, not zeros
    assert "text_encoder_3" not in build_components("mmdit-tiny") and model.t5_tokens == 8
    assert "tokenizer_3" not in bundled_tokenizers("mmdit-tiny")
    # Same seed, same weights for everything mmdit-tiny has: T5 is drawn after them.
    torch.manual_seed(0)
    without = build_components("mmdit-tiny")
    torch.manual_seed(0)
    with_t5 = build_components("mmdit-tiny-t5")
    for name in ("transformer", "vae", "text_encoder", "text_encoder_2"):
        theirs = with_t5[name].state_dict()
        assert all(v.equal(theirs[k]) for k, v in without[name].state_dict().items()), name


def _images_and_latents(shapes_mds, latents_dir, model):
    """Per key: the image data path's sample (given what `loader_inputs(model)` hands it) and the
    stored latents' sample."""
    config = dict(resolution=32, hflip=False, shuffle=False)
    images = build_image_caption_dataloader(
        ImageCaptionDataConfig(local=str(shapes_mds / "mds"), **config), model.tokenizer, 1, 8,
        **loader_inputs(model),
    ).dataset  # fmt: skip
    latents = LatentsDataset(resolution=32, local=str(latents_dir), shuffle=False, batch_size=1)

    def by_key(dataset):
        return {dataset.get_item(i)["key"]: dataset[i] for i in range(SAMPLES)}

    return by_key(images), by_key(latents)


@pytest.mark.heavy
def test_precomputed_latents_give_the_image_path_s_loss(shapes_mds, tmp_path):
    """`sd-convert latents --preset mmdit-tiny-t5 --t5` (random encoders, no --pretrained) stores T5's
    context beside both CLIPs'; the model with those encoders trains on it exactly what images and
    token ids (input_ids_3 from the data path) give: per sample, the same loss for the same
    global-RNG draws with caption dropout, and validation's seeded loss."""
    out = tmp_path / "latents"
    argv = ["latents", "--src", shapes_mds / "mds", "--out", out, "--preset", "mmdit-tiny-t5"]
    assert run_cli(*argv, "--resolutions", 32, "--batch-size", 32, "--t5") == 0
    assert "text_embeds_3" in json.loads((out / "index.json").read_text())["shards"][0]["column_names"]
    # The preset's model reads T5: its context is stored without --t5 too.
    assert run_cli(*argv[:4], tmp_path / "implied", *argv[5:], "--resolutions", 32) == 0
    assert "text_embeds_3" in read_mds(tmp_path / "implied")[0]

    model = build_model("mmdit-tiny-t5", caption_drop_prob=0.5).train()
    encoders = load_encoders("mmdit-tiny-t5", t5=True)
    for name in ("vae", "text_encoder", "text_encoder_2", "text_encoder_3"):
        getattr(model, name).load_state_dict(getattr(encoders, name).state_dict())
    images, latents = _images_and_latents(shapes_mds, out, model)
    assert latents.keys() == images.keys()
    sample = next(iter(images.values()))
    assert sample.keys() == {"image", "input_ids", "input_ids_2", "input_ids_3", "sample_index"}
    assert sample["input_ids_3"].shape == (8,) and sample["input_ids_3"].dtype == torch.int64
    assert next(iter(latents.values()))["text_embeds_3"].shape == (8, 128)

    keys = sorted(images)
    for key in keys:
        for seed in (1, 2):
            losses = []
            for sample in (images[key], latents[key]):
                batch = default_collate([sample])
                torch.manual_seed(seed)
                with torch.no_grad():
                    losses.append(model.loss(model(batch), batch))
            torch.testing.assert_close(losses[1], losses[0], rtol=2e-3, atol=1e-4)
    image_batch = default_collate([images[k] for k in keys])
    stored = default_collate([latents[k] for k in keys])
    with torch.no_grad():
        from_images = model.loss(model._diffuse(image_batch, seeds=list(range(SAMPLES))), image_batch)
        from_latents = model.loss(model._diffuse(stored, seeds=list(range(SAMPLES))), stored)
    torch.testing.assert_close(from_latents, from_images, rtol=2e-3, atol=1e-4)
    # Without T5's ids the model says what the batch lacks rather than training on zeros.
    with pytest.raises(ValueError, match="input_ids_3"):
        model.condition({k: v for k, v in image_batch.items() if k != "input_ids_3"}, False)


@pytest.mark.fit
def test_trains_from_images_and_its_checkpoint_exports_a_pipeline_with_t5(shapes_mds, tmp_path):
    """yamls/tiny-mmdit-cpu.yaml with model.preset=mmdit-tiny-t5 for 2 batches: every batch holds T5's
    ids, the checkpoint records T5 (its tokenizer rebuilt offline), and the export loads with plain
    StableDiffusion3Pipeline.from_pretrained (T5 included) and samples generate()'s image."""
    from composer import Callback

    overrides = [
        *tiny_run(shapes_mds, 2),
        "model.preset=mmdit-tiny-t5",
        f"trainer.save_folder={tmp_path / 'run'}",
        "trainer.save_filename=ckpt.pt",
    ]
    trainer = build_trainer(load_config(REPO / "yamls/tiny-mmdit-cpu.yaml", overrides))
    assert trainer.state.model.text_encoder_3 is not None
    losses = []

    class Losses(Callback):
        def before_forward(self, state, logger):
            assert state.batch["input_ids_3"].shape == (state.batch["input_ids"].shape[0], 8)

        def after_loss(self, state, logger):
            losses.append(float(state.loss))

    trainer.state.callbacks.append(Losses())
    trainer.fit()
    trainer.close()
    assert len(losses) == 2 and all(torch.isfinite(torch.tensor(losses)))

    checkpoint = tmp_path / "run" / "ckpt.pt"
    record = read_record(torch.load(checkpoint, weights_only=False)["state"])
    assert record["preset"] == "mmdit-tiny-t5" and record["text_encoder_3"]["d_model"] == 128
    model = load_model_from_checkpoint(checkpoint, ema=False)
    assert isinstance(model.tokenizer_3, T5TokenizerFast)
    folder = tmp_path / "export"
    export.main([str(checkpoint), str(folder), "--raw"])
    pipe = StableDiffusion3Pipeline.from_pretrained(folder, local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    assert isinstance(pipe.text_encoder_3, T5EncoderModel) and len(pipe.tokenizer_3) == T5_VOCAB_SIZE
    sampling = dict(guidance_scale=4.0, num_inference_steps=3)
    expected = model.generate(PROMPTS, seed=2, **sampling)
    images = pipe(
        PROMPTS, max_sequence_length=8, generator=torch.Generator().manual_seed(2), output_type="pt",
        height=32, width=32, **sampling,
    ).images  # fmt: skip
    torch.testing.assert_close(images, expected, atol=1e-6, rtol=0)


@pytest.mark.heavy
def test_sd3_medium_with_t5_hands_its_loader_t5_ids(shapes_mds):
    """yamls/sd3-medium.yaml with text_encoder_3 in pretrained_components passes the config checks, and
    the data path of the model it builds (on the meta device: shapes only; the folder's T5 tokenizer
    stood in for by the offline one) hands over T5's ids, 77 long, on which a training forward runs:
    the first batch from images no longer fails for want of input_ids_3."""
    required = ["data.train.remote=s3://bucket/mds", "model.pretrained=/models/sd3", "trainer.save_folder=/c"]
    components = "model.pretrained_components=[vae,text_encoder,tokenizer,text_encoder_3]"
    run = parse_config(load_config(REPO / "yamls/sd3-medium.yaml", [*required, components]))
    assert "text_encoder_3" in run.model["pretrained_components"]
    spec = PRESETS["sd3-medium"]
    with torch.device("meta"):
        parts = build_components("sd3-medium")
        t5 = T5EncoderModel(T5Config(**spec["text_encoder_3"]))
    model = RectifiedFlowTransformer(
        **parts, **bundled_tokenizers("sd3-medium"), text_encoder_3=t5, tokenizer_3=build_t5_tokenizer(),
        t5_tokens=spec["t5_tokens"],
    )  # fmt: skip
    inputs = loader_inputs(model)
    assert inputs["t5_tokenizer"] is model.tokenizer_3 and inputs["t5_tokens"] == 77
    config = ImageCaptionDataConfig(local=str(shapes_mds / "mds"), resolution=32, shuffle=False)
    dataset = build_image_caption_dataloader(
        config, model.tokenizer, 2, size_multiple("sd3-medium"), **inputs
    ).dataset
    batch = default_collate([dataset[0], dataset[1]])
    assert batch["input_ids_3"].shape == (2, 77)
    captions = [dataset.get_item(i)["caption"] for i in range(2)]
    assert torch.equal(batch["input_ids_3"], model.tokenize_t5(captions))
    model.train()
    prediction, target, t = model({name: value.to("meta") for name, value in batch.items()})
    assert prediction.shape == target.shape == (2, 16, 4, 4) and t.shape == (2,)
