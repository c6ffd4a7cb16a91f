import io

import numpy as np
import pytest
import torch
from PIL import Image
from torchvision import transforms

from data.image_caption import ImageCaptionDataset, cover_crop, image_transform
from data.loader import ImageCaptionDataConfig, build_image_caption_dataloader
from data.streaming_base import StreamingBase
from data.transforms import square_pixels
from models.engine.pixels import to_float
from models.engine.tokenizer import build_tokenizer, tokenize


def test_mds_reads_back_exactly_what_was_written(shapes_mds):
    images = sorted((shapes_mds / "images").glob("*.png"))
    ds = StreamingBase(local=str(shapes_mds / "mds"), shuffle=False, batch_size=1)
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
    assert sample["image"].shape == (3, 16, 16) and sample["image"].dtype == torch.uint8
    image = to_float(sample["image"])  # what the model makes of it on the device
    assert image.min() >= -1 and image.max() <= 1
    source = Image.open(shapes_mds / "images" / "000003.png").convert("RGB").resize((16, 16), Image.BILINEAR)
    expected = torch.from_numpy(np.asarray(source)).permute(2, 0, 1).float() / 127.5 - 1
    assert (image - expected).abs().mean() < 0.05
    # Training sees exactly the pixels `convert latents` encodes (image_transform, cover_crop).
    data = ds.get_item(3)["image"]
    for reference in (image_transform(16), lambda im: cover_crop(im, 16, 16)):
        assert torch.equal(image, reference(data))
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


@pytest.mark.heavy
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
    assert len(StreamingBase(local=str(tmp_path / "shapes"), batch_size=1)) == default_n
    assert sorted(p.name for p in tmp_path.iterdir()) == ["shapes"]  # no temporary folders left
    with pytest.raises(FileNotFoundError, match="nowhere"):
        ensure_dataset(ImageCaptionDataConfig(local=str(tmp_path / "nowhere")))
    with pytest.raises(ValueError, match="data.prepare='shapes' writes to `local`"):
        ensure_dataset(ImageCaptionDataConfig(remote="s3://bucket/shapes", prepare="shapes"))


def _photo(width: int, height: int, seed: int = 0) -> Image.Image:
    """Gradients and noise: every pixel differs, as in a photo."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    pixels = np.stack([x / width * 200, y / height * 200, (x + y) / (width + height) * 200], -1)
    pixels += rng.normal(0, 20, pixels.shape)
    return Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8))


# (width, height): landscape, portrait, odd sizes, a panorama, a plain crop (the shorter side is
# already R: no resize), upscaling; JPEGs of the first two and the last decode at 1/2 and 1/4 scale.
SIZES = [(1001, 667), (667, 1001), (512, 384), (1200, 300), (300, 256), (200, 150), (2048, 1536)]
LEVEL = 2 / 255  # one 8-bit level in [-1, 1] units


def _levels(ours: torch.Tensor, expected: torch.Tensor) -> tuple[float, float]:
    """(largest, mean) difference in 8-bit levels."""
    difference = (ours - expected).abs() / LEVEL
    return difference.max().item(), difference.mean().item()


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("mode", ["RGB", "L", "RGBA", "P", "CMYK"])
@pytest.mark.heavy
def test_image_transform_is_torchvisions_resize_and_center_crop(size, mode):
    """Within one 8-bit level of Resize(R) + CenterCrop(R) + ToTensor + Normalize on PIL, for an opened
    image and for encoded bytes decoded in full; JPEG bytes decoded at a reduced DCT scale (shorter
    side >= 2R) within a level on average."""
    resolution = 256
    image = _photo(*size).convert(mode)
    data = None
    if mode in ("L", "CMYK", "RGB"):  # JPEGs: the loader and `convert latents` get the bytes
        encoded = io.BytesIO()
        image.save(encoded, "JPEG", quality=90)
        data = encoded.getvalue()
        image = Image.open(io.BytesIO(data))
    steps = [transforms.Resize(resolution), transforms.CenterCrop(resolution), transforms.ToTensor()]
    expected = transforms.Compose([*steps, transforms.Normalize([0.5], [0.5])])(image.convert("RGB"))
    ours = image_transform(resolution)(image)
    assert ours.shape == (3, resolution, resolution) and ours.dtype == torch.float32
    largest, mean = _levels(ours, expected)
    assert largest <= 1 + 1e-4 and mean < 0.13
    uint8 = image_transform(resolution, uint8=True)(image)
    assert uint8.dtype == torch.uint8 and torch.equal(to_float(uint8), ours)
    if data is None:
        return
    assert torch.equal(to_float(square_pixels(data, resolution, draft=False)), ours)  # decode_jpeg = PIL
    drafted = image_transform(resolution)(data)
    assert drafted.shape == (3, resolution, resolution)
    if min(size) < 2 * resolution or mode == "CMYK":  # no reduced decode: the same pixels
        assert torch.equal(drafted, ours)
    else:  # a box-like DCT filter instead of a triangle one: measured 1.4-2.9 levels on average
        largest, mean = _levels(drafted, expected)  # a half-pixel shift gave 5.5 (data/transforms.py)
        assert largest <= 24 and mean < 3, (largest, mean)
        assert not torch.equal(drafted, ours)  # it did decode at a reduced scale


def test_a_corrupt_jpeg_is_an_os_error_as_with_pil():
    encoded = io.BytesIO()
    _photo(400, 300).save(encoded, "JPEG")
    with pytest.raises(OSError, match="corrupt JPEG"):
        square_pixels(encoded.getvalue()[:5000], 256)


def test_uint8_to_float_is_bit_identical_to_to_tensor_and_normalize():
    pixels = torch.arange(256, dtype=torch.uint8).repeat(3, 4, 1)  # every value, (3, 4, 256)
    image = Image.fromarray(pixels.permute(1, 2, 0).numpy())
    expected = transforms.Normalize([0.5], [0.5])(transforms.ToTensor()(image))
    assert torch.equal(to_float(pixels), expected)
