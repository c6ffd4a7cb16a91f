import numpy as np
import torch
from PIL import Image
from streaming import StreamingDataset

from data.image_caption import ImageCaptionDataset
from data.loader import ImageCaptionDataConfig, build_image_caption_dataloader
from models.tokenizer import build_tokenizer, tokenize


def test_mds_reads_back_exactly_what_was_written(shapes_mds):
    images = sorted((shapes_mds / "images").glob("*.png"))
    ds = StreamingDataset(local=str(shapes_mds / "mds"), shuffle=False, batch_size=1)
    assert len(ds) == len(images) == 64
    for i in (0, 17, 63):
        sample = ds[i]
        assert sample["key"] == images[i].stem
        assert sample["caption"] == images[i].with_suffix(".txt").read_text()
        assert sample["image"] == images[i].read_bytes()  # original bytes passed through
        assert (sample["width"], sample["height"]) == (32, 32)


def test_dataset_transforms_and_tokenizes(shapes_mds):
    tok = build_tokenizer()
    ds = ImageCaptionDataset(
        tokenizer=tok, resolution=16, local=str(shapes_mds / "mds"), shuffle=False, batch_size=1
    )
    sample = ds[3]
    assert sample["image"].shape == (3, 16, 16)
    assert sample["image"].min() >= -1 and sample["image"].max() <= 1
    source = Image.open(shapes_mds / "images" / "000003.png").convert("RGB").resize((16, 16), Image.BILINEAR)
    expected = torch.from_numpy(np.asarray(source)).permute(2, 0, 1).float() / 127.5 - 1
    assert (sample["image"] - expected).abs().mean() < 0.05
    caption = (shapes_mds / "images" / "000003.txt").read_text()
    assert torch.equal(sample["input_ids"], tokenize(tok, [caption])[0])


def test_hflip_is_a_deterministic_half_of_the_samples(shapes_mds):
    tok = build_tokenizer()
    common = dict(tokenizer=tok, resolution=32, local=str(shapes_mds / "mds"), shuffle=False, batch_size=1)
    plain, flipping = ImageCaptionDataset(**common), ImageCaptionDataset(**common, hflip=True)
    flipped = 0
    for i in range(64):
        image, reference = flipping[i]["image"], plain[i]["image"]
        assert torch.equal(image, flipping[i]["image"])  # no global RNG: the same every time
        if torch.equal(image, reference.flip(-1)) and not torch.equal(image, reference):
            flipped += 1
        else:
            assert torch.equal(image, reference)
    assert 16 <= flipped <= 48


def test_dataloader_uses_per_device_batch(shapes_mds):
    cfg = ImageCaptionDataConfig(local=str(shapes_mds / "mds"), resolution=32)
    batch = next(iter(build_image_caption_dataloader(cfg, build_tokenizer(), batch_size=8)))
    assert batch["image"].shape == (8, 3, 32, 32)
    assert batch["input_ids"].shape == (8, 77)


def test_prepared_dataset_is_built_once_and_missing_data_is_named(tmp_path):
    import inspect

    import pytest

    from recipes.prepare import ensure_dataset, prepare_shapes_mds

    cfg = ImageCaptionDataConfig(local=str(tmp_path / "shapes"), prepare="shapes")
    ensure_dataset(cfg)
    index = tmp_path / "shapes" / "index.json"
    first = index.stat().st_mtime_ns
    ensure_dataset(cfg)  # already there: not rebuilt
    assert index.stat().st_mtime_ns == first
    default_n = inspect.signature(prepare_shapes_mds).parameters["n"].default
    assert len(StreamingDataset(local=str(tmp_path / "shapes"), batch_size=1)) == default_n
    assert sorted(p.name for p in tmp_path.iterdir()) == ["shapes"]  # no temporary folders left
    with pytest.raises(FileNotFoundError, match="nowhere"):
        ensure_dataset(ImageCaptionDataConfig(local=str(tmp_path / "nowhere")))
    with pytest.raises(ValueError, match="data.prepare='shapes' writes to `local`"):
        ensure_dataset(ImageCaptionDataConfig(remote="s3://bucket/shapes", prepare="shapes"))
