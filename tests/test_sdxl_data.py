"""SDXL's data path (issue 25): the converter keeps each image's original size, the image loader hands
an SDXL model its second tokenizer's ids and micro-conditioning (original size, crop top-left), and
`sd-convert latents` for an SDXL preset stores what training on the images computes. The values are
worked out by hand from the images' sizes; an SD model's batches stay what they were.

The images, converted with --resize-max 25 (so that the original size is not the stored one), and
trained at resolution 16 on a preset whose sizes are multiples of 8 (sdxl-tiny, tiny):
- `wide`: 412x100 -> stored 103x25, original (height, width) (100, 412); bucket ar2 of --buckets 1,2.
- `small`: 24x20, stored as it is (its shorter side is under 25): original (20, 24); bucket ar1.
"""

import numpy as np
import pytest
import torch
from torch.utils.data import default_collate

from convert.common import BASE_COLUMNS
from convert.encoders import load_encoders
from convert.images import ImageOptions, prepare_image_sized
from convert.mds import write_mds
from data.image_caption import ImageCaptionDataset, cover_crop
from data.loader import ImageCaptionDataConfig, build_image_caption_dataloader
from data.transforms import square_pixels
from models import build_model
from models.engine.tokenizer import build_tokenizer, tokenize
from recipes import load_config
from recipes.config import parse_config
from recipes.trainer import trainer_kwargs
from tests.conftest import REPO, tiny_run
from tests.convert_fixtures import encode, exif_rotated_jpeg, jpeg, photo, read_mds, run_cli

RESOLUTION, MULTIPLE = 16, 8
ORIGINAL = {"wide": (100, 412), "small": (20, 24)}  # (height, width)
STORED = {"wide": (25, 103), "small": (20, 24)}


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """`plain/` and `bucketed/` (--buckets 1,2) conversions of the two images, --resize-max 25."""
    root = tmp_path_factory.mktemp("sdxl-data")
    images = root / "images"
    images.mkdir()
    for key, (height, width), seed in (("wide", ORIGINAL["wide"], 1), ("small", ORIGINAL["small"], 2)):
        (images / f"{key}.jpg").write_bytes(encode(photo(width, height, seed=seed)))
        (images / f"{key}.txt").write_text(f"a {key} photo")
    argv = ["folder", "--src", images, "--resize-max", 25]
    assert run_cli(*argv, "--out", root / "plain") == 0
    assert run_cli(*argv, "--out", root / "bucketed", "--buckets", "1,2") == 0
    return root


def data_config(local, layout: str, **kwargs) -> ImageCaptionDataConfig:
    bucketed = dict(buckets=True, batching_method="per_stream") if layout == "bucketed" else {}
    return ImageCaptionDataConfig(
        local=str(local), resolution=RESOLUTION, hflip=False, shuffle=False, **bucketed, **kwargs
    )


def loader(local, tokenizer, layout: str, **kwargs):
    return build_image_caption_dataloader(data_config(local, layout), tokenizer, 1, MULTIPLE, **kwargs)


def sdxl_keys(model) -> dict:
    """What recipes/trainer.py passes the loader for `model`."""
    return dict(tokenizer_2=model.tokenizer_2, micro_conditioning=model.micro_conditioning)


def by_key(dataset) -> dict[str, dict]:
    return {dataset.get_item(i)["key"]: dataset[i] for i in range(len(dataset))}


def test_the_converter_keeps_each_images_original_size(converted):
    def sizes(data, **options):
        image = prepare_image_sized(data, ImageOptions(**options))
        return (image.width, image.height), (image.original_width, image.original_height)

    assert sizes(jpeg(48, 32)) == ((48, 32), (48, 32))  # passed through untouched
    assert sizes(jpeg(300, 200), resize_max=100) == ((150, 100), (300, 200))
    # Stored 60x40 with EXIF orientation 6 (shown turned): the original size is upright, as training sees it.
    assert sizes(exif_rotated_jpeg(60, 40), resize_max=20) == ((20, 30), (40, 60))
    assert sizes(exif_rotated_jpeg(60, 40)) == ((40, 60), (40, 60))  # turned, not resized
    # --center-crop: the stored pixels show the centred square, whose size before the resize is 60x60.
    assert sizes(encode(photo(90, 60), "PNG"), resize_max=30, center_crop=True) == ((30, 30), (60, 60))

    for layout in ("plain", "bucketed"):
        rows = {row["key"]: row for row in read_mds(converted / layout)}
        for key, (height, width) in ORIGINAL.items():
            assert (rows[key]["original_height"], rows[key]["original_width"]) == (height, width)
            assert (rows[key]["height"], rows[key]["width"]) == STORED[key]


def test_micro_conditioning_of_a_square_crop(converted):
    """Resize(16) then CenterCrop(16): wide 103x25 -> 65x16 (16 x 103 / 25 = 65.9, truncated), left
    round(49 / 2) = 24 (half to even); small 24x20 -> 19x16, left round(3 / 2) = 2. Mirrored, the
    crop's left edge is 65 - 24 - 16 = 25 and 19 - 2 - 16 = 1."""
    model = build_model("sdxl-tiny")
    dataset = loader(converted / "plain", model.tokenizer, "plain", **sdxl_keys(model)).dataset
    samples = by_key(dataset)
    expected = {"wide": (0, 24), "small": (0, 2)}
    for key, sample in samples.items():
        assert sample.keys() == {
            "image",
            "input_ids",
            "input_ids_2",
            "original_size",
            "crop_top_left",
            "sample_index",
        }
        assert sample["original_size"].dtype == sample["crop_top_left"].dtype == torch.int64
        assert sample["original_size"].tolist() == list(ORIGINAL[key])
        assert sample["crop_top_left"].tolist() == list(expected[key])
        assert torch.equal(sample["input_ids_2"], tokenize(model.tokenizer_2, [f"a {key} photo"])[0])
        assert torch.equal(sample["input_ids"], tokenize(model.tokenizer, [f"a {key} photo"])[0])
    assert not torch.equal(samples["wide"]["input_ids"], samples["wide"]["input_ids_2"])  # "!" pads 2

    dataset.hflip, dataset._flips = True, lambda index: True
    flipped = by_key(dataset)
    assert flipped["wide"]["crop_top_left"].tolist() == [0, 25]
    assert flipped["small"]["crop_top_left"].tolist() == [0, 1]
    for key in samples:
        assert torch.equal(flipped[key]["image"], samples[key]["image"].flip(-1))
        assert torch.equal(flipped[key]["original_size"], samples[key]["original_size"])


def test_micro_conditioning_of_a_bucketed_crop(converted):
    """Bucket ar2 at 16 px is 8x24 (16 / sqrt 2 = 11.3 and 16 x sqrt 2 = 22.6, to multiples of 8).
    Wide 103x25 covers it at scale max(8 / 25, 24 / 103) = 0.32: 33x8 (32.96 rounded), left
    round(9 / 2) = 4 (half to even), top 0; mirrored, 33 - 4 - 24 = 5. Bucket ar1 is 16x16: small
    gets the square crop, (0, 2)."""
    model = build_model("sdxl-tiny")
    dataset = loader(converted / "bucketed", model.tokenizer, "bucketed", **sdxl_keys(model)).dataset
    samples = by_key(dataset)
    assert samples["wide"]["image"].shape == (3, 8, 24) and samples["small"]["image"].shape == (3, 16, 16)
    for key, crop in (("wide", [0, 4]), ("small", [0, 2])):
        assert samples[key]["original_size"].tolist() == list(ORIGINAL[key])
        assert samples[key]["crop_top_left"].tolist() == crop

    dataset.hflip, dataset._flips = True, lambda index: True
    flipped = by_key(dataset)
    assert flipped["wide"]["crop_top_left"].tolist() == [0, 5]
    assert flipped["small"]["crop_top_left"].tolist() == [0, 1]
    for key in samples:
        assert torch.equal(flipped[key]["image"], samples[key]["image"].flip(-1))


def test_without_the_flags_samples_are_as_before(converted, tmp_path):
    """An SD model's samples: no new keys, the same pixels as the transforms give; and a set
    converted before the original-size columns existed conditions on the stored image's size."""
    tokenizer = build_tokenizer()
    buckets = {"wide": (8, 24), "small": (16, 16)}
    for layout in ("plain", "bucketed"):
        dataset = loader(converted / layout, tokenizer, layout).dataset
        for i in range(len(dataset)):
            sample, row = dataset[i], dataset.get_item(i)
            assert sample.keys() == {"image", "input_ids", "sample_index"}
            if layout == "plain":
                assert torch.equal(sample["image"], square_pixels(row["image"], RESOLUTION))
            else:
                assert torch.equal(sample["image"], cover_crop(row["image"], *buckets[row["key"]]))

    old_columns = {k: v for k, v in BASE_COLUMNS.items() if not k.startswith("original_")}
    rows = [{k: row[k] for k in old_columns} for row in read_mds(converted / "plain")]
    write_mds(rows, str(tmp_path / "old"), old_columns)
    dataset = ImageCaptionDataset(
        tokenizer=tokenizer,
        resolution=RESOLUTION,
        micro_conditioning=True,
        local=str(tmp_path / "old"),
        shuffle=False,
        batch_size=1,
    )
    for key, sample in by_key(dataset).items():
        assert sample["original_size"].tolist() == list(STORED[key])
        assert "input_ids_2" not in sample  # no second tokenizer given


@pytest.mark.heavy
def test_the_trainer_hands_each_model_its_keys(shapes_mds):
    for recipe, sdxl in (("tiny-sdxl-cpu", True), ("tiny-cpu", False)):
        run = parse_config(load_config(REPO / f"yamls/{recipe}.yaml", tiny_run(shapes_mds, 1)))
        kwargs = trainer_kwargs(run, world_size=1)
        dataset = kwargs["train_dataloader"].dataset
        assert dataset.micro_conditioning is sdxl
        assert dataset.tokenizer_2 is (kwargs["model"].tokenizer_2 if sdxl else None)
        keys = {"image", "input_ids", "sample_index"} | (
            {"input_ids_2", "original_size", "crop_top_left"} if sdxl else set()
        )
        assert dataset[0].keys() == keys


@pytest.mark.parametrize("layout", ["plain", "bucketed"])
@pytest.mark.heavy
def test_sdxl_tiny_precomputed_latents_give_the_image_paths_loss(converted, layout, tmp_path):
    """`sd-convert latents --preset sdxl-tiny` stores both encoders' context, the pooled vector and the
    micro-conditioning the image path computes; trained on, the same loss for the same draws."""
    out = tmp_path / "latents"
    argv = ["latents", "--src", converted / layout, "--out", out, "--preset", "sdxl-tiny"]
    assert run_cli(*argv, "--resolutions", RESOLUTION, "--batch-size", 2) == 0
    model = build_model("sdxl-tiny", caption_drop_prob=0.5)
    encoders = load_encoders("sdxl-tiny")  # what the conversion encoded with
    for name in ("vae", "text_encoder", "text_encoder_2"):
        getattr(model, name).load_state_dict(getattr(encoders, name).state_dict())
    model.train()

    images = by_key(loader(converted / layout, model.tokenizer, layout, **sdxl_keys(model)).dataset)
    cfg = data_config(out, layout, latents=True)
    latents = by_key(build_image_caption_dataloader(cfg, None, 1, MULTIPLE).dataset)
    assert latents.keys() == images.keys() == ORIGINAL.keys()
    for key, image in images.items():
        stored = latents[key]
        context_width = model.unet.config.cross_attention_dim
        pooled_width = model.text_encoder_2.config.projection_dim
        assert stored["text_embeds"].shape == (77, context_width)
        assert stored["pooled_text_embeds"].shape == (pooled_width,)
        assert torch.equal(stored["original_size"], image["original_size"])
        assert torch.equal(stored["crop_top_left"], image["crop_top_left"])
        context, pooled = model.encode_text(image["input_ids"][None], image["input_ids_2"][None])
        torch.testing.assert_close(stored["text_embeds"], context[0], rtol=1e-2, atol=1e-3)
        torch.testing.assert_close(stored["pooled_text_embeds"], pooled[0], rtol=1e-2, atol=1e-3)
        for seed in (1, 2):  # drop the caption or not (caption_drop_prob 0.5)
            losses = []
            for sample in (image, stored):
                torch.manual_seed(seed)
                batch = default_collate([sample])
                losses.append(model.loss(model(batch), batch))
            torch.testing.assert_close(losses[1], losses[0], rtol=2e-3, atol=1e-4)
    row = read_mds(out)[0]
    assert row["original_size"].dtype == row[f"crop_top_left_{RESOLUTION}"].dtype == np.int64
