"""The mmdit family's data path (issue 26): `sd-convert latents --preset mmdit-tiny` stores what
RectifiedFlowTransformer reads instead of images and token ids (both CLIPs' unpadded context, the
pooled vector, the VAE moments unscaled; T5's context when the pretrained folder has a T5), and
`recipes.prepare`'s random sd3-medium latents have the shapes sd3-medium reads (a training forward on
the meta device). (That training on the stored columns gives the image path's loss for the same draws:
tests/test_families.py.)"""

import json

import numpy as np
import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler, StableDiffusion3Pipeline
from torch.utils.data import default_collate

from convert.common import ConvertError
from convert.encoders import has_t5, load_encoders
from convert.latents import columns, convert_latents, pixel_sizes, preset_columns
from data.latent_dataset import LatentsDataset
from data.loader import ImageCaptionDataConfig, build_image_caption_dataloader, collate
from models import build_model
from models.engine.tokenizer import build_t5_tokenizer
from models.presets import size_multiple
from models.registry import PRESETS
from recipes.prepare import PREPARERS, prepare_random_latents, prepare_sd3_latents
from recipes.trainer import loader_inputs
from tests.convert_fixtures import read_mds, run_cli

RESOLUTION = 32  # the shapes' size; mmdit-tiny's 8 x 8 latents
T5_PARTS = ["vae", "text_encoder", "tokenizer", "text_encoder_3"]


def tiny_model(**options):
    """mmdit-tiny with the encoders `sd-convert latents` used (seed 0's random weights)."""
    model = build_model("mmdit-tiny", **options)
    encoders = load_encoders("mmdit-tiny")
    for name in ("vae", "text_encoder", "text_encoder_2"):
        getattr(model, name).load_state_dict(getattr(encoders, name).state_dict())
    return model


@pytest.fixture(scope="module")
def tiny_latents(shapes_mds, tmp_path_factory):
    """`sd-convert latents --preset mmdit-tiny` of the 64 shapes at 32 px (random encoders)."""
    out = tmp_path_factory.mktemp("mmdit-latents") / "latents"
    argv = ["latents", "--src", shapes_mds / "mds", "--out", out, "--preset", "mmdit-tiny"]
    assert run_cli(*argv, "--resolutions", RESOLUTION, "--batch-size", 32) == 0
    return out


def test_the_columns_of_each_family():
    assert preset_columns("sd2-base", [256]) == columns([256])
    assert preset_columns("sdxl-base", [512]) == columns([512], True)
    assert preset_columns("mmdit-tiny", [32]) == {
        "caption": "str",
        "key": "str",
        "text_embeds": "ndarray:float16",
        "latents_32": "ndarray:float16",
        "pooled_text_embeds": "ndarray:float16",
    }
    assert preset_columns("sd3-medium", [256], t5=True)["text_embeds_3"] == "ndarray:float16"
    with pytest.raises(ValueError, match="reads no T5"):
        preset_columns("sdxl-base", [512], t5=True)
    # Bucket sizes are multiples of the preset's VAE x denoiser factor: 8 for mmdit-tiny (4 x patch 2),
    # 16 for sd3-medium, still 64 for sd2-base (320x192 at 256 px, as before).
    assert pixel_sizes("ar2", [16], "mmdit-tiny") == {16: (8, 24)}
    assert size_multiple("sd3-medium") == 16
    assert pixel_sizes("ar0.75", [256], "sd3-medium") == {256: (288, 224)}
    assert pixel_sizes("ar0.75", [256], "sd2-base") == {256: (320, 192)}
    assert pixel_sizes("", [256], "sd3-medium") == {256: (256, 256)}
    assert not has_t5(None)


@pytest.mark.heavy
def test_stored_columns_and_shapes(tiny_latents):
    row = read_mds(tiny_latents)[0]
    spec = PRESETS["mmdit-tiny"]
    clip = spec["text_encoder"]["hidden_size"] + spec["text_encoder_2"]["hidden_size"]
    pooled = spec["transformer"]["pooled_projection_dim"]
    assert row.keys() == {"caption", "key", "text_embeds", "pooled_text_embeds", f"latents_{RESOLUTION}"}
    assert row["text_embeds"].shape == (77, clip) == (77, 64)  # unpadded (the joint width is 128)
    assert row["pooled_text_embeds"].shape == (pooled,)
    # The 4-channel moments (mean and logvar) at 32 px / 4.
    assert row[f"latents_{RESOLUTION}"].shape == (2 * spec["vae"]["latent_channels"], 8, 8)
    assert all(row[name].dtype == np.float16 for name in ("text_embeds", "pooled_text_embeds", "latents_32"))
    sample = LatentsDataset(resolution=RESOLUTION, local=str(tiny_latents), shuffle=False, batch_size=1)[0]
    assert sample.keys() == {"latents", "text_embeds", "pooled_text_embeds", "sample_index"}
    assert sample["sample_index"] == 0  # its index in the set (models/engine/draw_keys.py)
    assert all(
        sample[name].dtype == torch.float32 for name in ("latents", "text_embeds", "pooled_text_embeds")
    )


def test_the_image_loader_hands_both_clips_ids_and_no_t5_s(shapes_mds):
    """What recipes/trainer.py passes the image loader for mmdit-tiny, a model without T5 (with T5:
    tests/test_mmdit_t5.py). That what it trains on from images and from the stored columns gives the
    same loss: tests/test_families.py."""
    model = build_model("mmdit-tiny")
    config = ImageCaptionDataConfig(local=str(shapes_mds / "mds"), resolution=RESOLUTION, shuffle=False)
    dataset = build_image_caption_dataloader(config, model.tokenizer, 1, 8, **loader_inputs(model)).dataset
    assert dataset[0].keys() == {"image", "input_ids", "input_ids_2", "sample_index"}


def _sd3_folder(folder) -> None:
    """A StableDiffusion3Pipeline folder of mmdit-tiny (seed 0's encoders) with a toy T5."""
    from transformers import T5Config, T5EncoderModel

    model = tiny_model()
    tokenizer_3 = build_t5_tokenizer()
    torch.manual_seed(4)
    config = dict(PRESETS["mmdit-tiny"]["text_encoder_3"], vocab_size=len(tokenizer_3))
    StableDiffusion3Pipeline(
        transformer=model.transformer,
        scheduler=FlowMatchEulerDiscreteScheduler.from_config(model.noise_scheduler.config),
        vae=model.vae,
        text_encoder=model.text_encoder,
        tokenizer=model.tokenizer,
        text_encoder_2=model.text_encoder_2,
        tokenizer_2=model.tokenizer_2,
        text_encoder_3=T5EncoderModel(T5Config(**config)).eval(),
        tokenizer_3=tokenizer_3,
    ).save_pretrained(folder)


@pytest.mark.heavy
def test_a_folder_with_t5_stores_its_context(shapes_mds, tmp_path):
    """--pretrained a folder with text_encoder_3/: `text_embeds_3` (t5_tokens, d_model) fp16 is what
    the model with T5 computes, and the stored context is the one it trains on from token ids."""
    folder = tmp_path / "sd3"
    _sd3_folder(folder)
    assert has_t5(str(folder))
    argv = ["latents", "--src", shapes_mds / "mds", "--preset", "mmdit-tiny", "--resolutions", 16]
    argv += ["--batch-size", 32, "--pretrained", folder]
    # T5 is opt-in: the folder's T5 is not stored without --t5 (the recipes train without T5).
    assert run_cli(*argv, "--out", tmp_path / "clip-only") == 0
    columns = json.loads((tmp_path / "clip-only/index.json").read_text())["shards"][0]["column_names"]
    assert "text_embeds_3" not in columns
    out = tmp_path / "latents"
    assert run_cli(*argv, "--out", out, "--t5") == 0
    assert "text_embeds_3" in json.loads((out / "index.json").read_text())["shards"][0]["column_names"]

    model = build_model("mmdit-tiny", pretrained=str(folder), pretrained_components=T5_PARTS)
    rows = read_mds(out)[:4]
    dataset = LatentsDataset(resolution=16, local=str(out), shuffle=False, batch_size=1)
    batch = collate([dataset[i] for i in range(len(rows))])
    assert batch.keys() == {"latents", "text_embeds", "pooled_text_embeds", "text_embeds_3", "sample_index"}
    assert rows[0]["text_embeds_3"].dtype == np.float16
    assert batch["text_embeds_3"].shape == (4, model.t5_tokens, 128) == (4, 8, 128)
    captions = [row["caption"] for row in rows]
    t5 = model.encode_t5(model.tokenize_t5(captions))
    torch.testing.assert_close(batch["text_embeds_3"], t5, rtol=1e-2, atol=1e-3)
    context, pooled = model.encode_captions(captions, "cpu")
    assert not context[:, 77:].eq(0).all()  # T5's embeddings, not zeros
    condition = model.condition(batch, False)
    torch.testing.assert_close(condition["encoder_hidden_states"], context, rtol=1e-2, atol=1e-3)
    torch.testing.assert_close(condition["pooled_projections"], pooled, rtol=1e-2, atol=1e-3)

    # A model without T5 refuses T5's context rather than training on what it cannot sample with.
    with pytest.raises(ValueError, match="text_embeds_3"):
        build_model("mmdit-tiny").condition(batch, False)
    assert not has_t5(str(tmp_path))  # a folder without text_encoder_3/
    with pytest.raises(ConvertError, match="--t5 needs --pretrained"):
        convert_latents(shapes_mds / "mds", tmp_path / "x", [16], "mmdit-tiny", t5=True)


@pytest.mark.heavy
def test_random_sd3_latents_have_what_sd3_medium_reads(tmp_path):
    """`data.train.prepare: sd3-latents` (bench/gpu/gpu_check.py's data): 16-channel moments at 256 and
    512 px, the unpadded CLIP context and the pooled vector; a training forward of sd3-medium (on the
    meta device: shapes only) takes a batch of them, and T5's context when asked for."""
    assert PREPARERS["sd3-latents"] is prepare_sd3_latents
    assert prepare_sd3_latents.__defaults__ == (512, (256, 512))
    local = prepare_sd3_latents(tmp_path / "sd3", n=2, resolutions=(256, 512))
    spec = PRESETS["sd3-medium"]
    for resolution in (256, 512):
        sample = LatentsDataset(resolution=resolution, local=str(local), shuffle=False, batch_size=1)[0]
        side = resolution // 8
        assert sample["latents"].shape == (2 * spec["transformer"]["in_channels"], side, side)
        assert sample["text_embeds"].shape == (77, 768 + 1280)
        assert sample["pooled_text_embeds"].shape == (spec["transformer"]["pooled_projection_dim"],)
        assert "text_embeds_3" not in sample
    # The model's view: (moments - shift) * scale of about unit variance.
    mean = sample["latents"][:16]
    assert abs(float(((mean - spec["latent_shift"]) * spec["latent_scale"]).std()) - 1) < 0.05

    with_t5 = prepare_random_latents(tmp_path / "t5", "sd3-medium", n=2, resolutions=(256,), t5=True)
    dataset = LatentsDataset(resolution=256, local=str(with_t5), shuffle=False, batch_size=2)
    batch = default_collate([dataset[0], dataset[1]])  # every column a tensor, for the meta device
    assert batch["text_embeds_3"].shape == (2, 77, 4096)
    with torch.device("meta"):
        model = build_model("sd3-medium", caption_drop_prob=0.1)
    model.train()
    on_meta = {name: batch[name].to("meta") for name in batch.keys() - {"text_embeds_3"}}
    prediction, target, t = model(on_meta)
    assert prediction.shape == target.shape == (2, 16, 32, 32) and t.shape == (2,)
    assert model.loss((prediction, target, t), on_meta).shape == ()
    with pytest.raises(ValueError, match="reads none"):  # T5's context needs a model with T5
        model({name: value.to("meta") for name, value in batch.items()})

    tiny = tiny_model().train()
    local = prepare_random_latents(tmp_path / "tiny", "mmdit-tiny", n=2, resolutions=(32,))
    dataset = LatentsDataset(resolution=32, local=str(local), shuffle=False, batch_size=2)
    batch = collate([dataset[0], dataset[1]])
    loss = tiny.loss(tiny(batch), batch)
    loss.backward()
    assert torch.isfinite(loss) and all(p.grad is not None for p in tiny.transformer.parameters())
