"""One image or caption at a time: what is kept untouched, repaired, resized, or skipped and why."""

import io
import json
import math

import numpy as np
import pytest
from PIL import Image

from convert.cli import parse_args
from convert.common import BASE_COLUMNS, LAION_COLUMNS, Skipped
from convert.images import MIN_SIDE, ImageOptions, SkipSample, prepare_image
from convert.samples import Options, bucket_name, clean_caption, prepare
from data.headers import sniff
from tests.convert_fixtures import (
    close,
    encode,
    exif_rotated_jpeg,
    hostile_images,
    jpeg,
    photo,
    pixels,
    read_mds,
    repairable_images,
    run_cli,
)


def test_plain_jpeg_and_png_pass_through_byte_for_byte():
    for data in (jpeg(48, 32), encode(photo(48, 32), "PNG"), encode(photo(48, 32).convert("L"), "PNG")):
        assert prepare_image(data, ImageOptions()) == (data, 48, 32, ())
        assert prepare_image(data, ImageOptions(verify="decode")) == (data, 48, 32, ())


def test_header_sniffing_matches_pil():
    cases = [jpeg(33, 17), encode(photo(33, 17).convert("L"), "JPEG"), encode(photo(33, 17), "PNG")]
    cases.append(encode(photo(33, 17), "JPEG", progressive=True))
    for data in cases:
        head, image = sniff(data), Image.open(io.BytesIO(data))
        assert (head.width, head.height, head.mode) == (*image.size, image.mode)
        assert head.passthrough
    assert sniff(b"GIF89a....") is None
    assert not sniff(jpeg()[:-100]).complete


@pytest.mark.parametrize("name", sorted(hostile_images()))
def test_hostile_images_are_skipped_with_their_reason(name):
    data, reason = hostile_images()[name]
    for verify in ("header", "decode"):
        with pytest.raises(SkipSample) as skip:
            prepare_image(data, ImageOptions(verify=verify))
        assert skip.value.reason == reason


def _gif_claiming(width: int, height: int) -> bytes:
    """A small GIF whose logical screen claims width x height: a header our sniffer does not read, so
    the size comes from PIL's parser."""
    data = bytearray(encode(photo(30, 20), "GIF"))
    data[6:10] = width.to_bytes(2, "little") + height.to_bytes(2, "little")
    return bytes(data)


def test_pixel_limit_is_an_option_and_checked_before_decoding(monkeypatch):
    data = jpeg(200, 100)
    with pytest.raises(SkipSample, match="too_many_pixels"):
        prepare_image(data, ImageOptions(max_pixels=200 * 100 - 1))
    assert prepare_image(data, ImageOptions(max_pixels=200 * 100))[1:3] == (200, 100)
    # A bomb is refused from its header: no decoder is ever made. The PNG's header is read by our
    # sniffer, the GIF's (40000 x 40000) by PIL's parser, whose own bomb check is not what refuses it.
    bombs = {"png": hostile_images()["bomb"][0], "gif": _gif_claiming(40_000, 40_000)}
    small = _gif_claiming(40, 40)
    decoders = []
    make_decoder = Image._getdecoder
    monkeypatch.setattr(Image, "_getdecoder", lambda *a, **k: decoders.append(a) or make_decoder(*a, **k))
    assert sniff(bombs["png"]) is not None and sniff(bombs["gif"]) is None
    for data in bombs.values():
        for verify in ("header", "decode"):
            with pytest.raises(SkipSample, match="too_many_pixels"):
                prepare_image(data, ImageOptions(verify=verify))
    assert decoders == []
    # max_pixels, not PIL's global limit, decides: the same GIF header at the limit is decoded.
    with pytest.raises(SkipSample, match="too_many_pixels"):
        prepare_image(small, ImageOptions(max_pixels=40 * 40 - 1, verify="decode"))
    assert decoders == []
    prepare_image(small, ImageOptions(max_pixels=40 * 40, verify="decode"))
    assert decoders  # the check above is not passing only because nothing ever decodes
    assert Image.MAX_IMAGE_PIXELS == 89_478_485  # PIL's global limit is left as it was


def test_gif_and_webp_go_through_pil():
    for fmt in ("GIF", "WEBP"):
        data = encode(photo(30, 20), fmt)
        assert prepare_image(data, ImageOptions())[:3] == (data, 30, 20)
        with pytest.raises(SkipSample, match="truncated_image|corrupt_image|not_an_image"):
            prepare_image(data[: len(data) // 2], ImageOptions())


@pytest.mark.parametrize("name", sorted(repairable_images()))
def test_repairable_images_become_rgb(name):
    data, expected, reason = repairable_images()[name]
    out, width, height, repairs = prepare_image(data, ImageOptions())
    assert repairs == (reason,)
    decoded = Image.open(io.BytesIO(out))
    assert decoded.mode == "RGB" and decoded.size == (width, height) == expected.shape[1::-1]
    tol = 6.0 if decoded.format == "JPEG" else 1.0  # a JPEG source is re-encoded as JPEG (4:2:0 chroma)
    assert close(pixels(out), expected, tol), np.abs(pixels(out) - expected).mean()
    assert 0x0112 not in decoded.getexif()  # nothing left for a reader to rotate again


def test_resize_shorter_side_never_upscales_and_applies_exif_orientation():
    data = jpeg(300, 200, seed=1)
    out, w, h, repairs = prepare_image(data, ImageOptions(resize_max=100))
    assert (w, h, repairs) == (150, 100, ())
    reference = photo(300, 200, seed=1).resize((150, 100), Image.Resampling.LANCZOS)
    assert close(pixels(out), np.asarray(reference, dtype=np.float64), tol=3.0)
    assert prepare_image(data, ImageOptions(resize_max=400)) == (
        data,
        300,
        200,
        (),
    )  # already small: untouched

    rotated = exif_rotated_jpeg(60, 40, seed=2)  # stored 60x40, displayed 40x60
    out, w, h, repairs = prepare_image(rotated, ImageOptions(resize_max=20))
    assert (w, h) == (20, 30) and repairs == ("exif_orientation",)
    upright = np.rot90(np.asarray(photo(60, 40, seed=2)), k=-1)
    expected = np.asarray(
        Image.fromarray(np.ascontiguousarray(upright)).resize((20, 30), Image.Resampling.LANCZOS)
    )
    assert close(pixels(out), expected.astype(np.float64), tol=6.0)


def test_center_crop_and_encode_formats():
    data = encode(photo(90, 60, seed=4), "PNG")
    out, w, h, _ = prepare_image(data, ImageOptions(resize_max=30, center_crop=True))
    assert (w, h) == (30, 30) and Image.open(
        io.BytesIO(out)
    ).format == "PNG"  # lossless source stays lossless
    expected = photo(90, 60, seed=4).crop((15, 0, 75, 60)).resize((30, 30), Image.Resampling.LANCZOS)
    assert close(pixels(out), np.asarray(expected, dtype=np.float64), tol=1.0)
    out, *_ = prepare_image(data, ImageOptions(resize_max=30, encode_format="webp"))
    assert Image.open(io.BytesIO(out)).format == "WEBP"
    out, w, h, _ = prepare_image(jpeg(40, 40), ImageOptions(center_crop=True))
    assert (w, h) == (40, 40)


def test_jpeg_draft_decoding_keeps_quality():
    data = jpeg(800, 600, seed=9)
    out, w, h, _ = prepare_image(data, ImageOptions(resize_max=96))
    assert (w, h) == (128, 96)
    full = photo(800, 600, seed=9).resize((128, 96), Image.Resampling.LANCZOS)
    assert close(pixels(out), np.asarray(full, dtype=np.float64), tol=2.0)


def test_min_side():
    with pytest.raises(SkipSample, match="filtered_min_side"):
        prepare_image(jpeg(60, 20), ImageOptions(min_side=32))


def test_tiny_images_are_skipped_and_counted_by_default(tmp_path):
    """`sd-convert folder` on a 1x1, an 8x8, a 40x12 and a 32x32 image: the first three are below the
    default --min-side (16) and counted as filtered_min_side in <out>/convert-report.json instead of
    being trained as a 256 px blur; --min-side 0 keeps them all."""
    src = tmp_path / "images"
    src.mkdir()
    sizes = {"one": (1, 1), "eight": (8, 8), "thin": (40, 12), "kept": (32, 32)}
    for name, size in sizes.items():
        (src / f"{name}.png").write_bytes(encode(photo(*size), "PNG"))
        (src / f"{name}.txt").write_text(f"a {name} image")
    assert run_cli("folder", "--src", src, "--out", tmp_path / "out") == 0
    report = json.loads((tmp_path / "out" / "convert-report.json").read_text())
    assert report["samples_skipped"] == {"filtered_min_side": 3} and report["samples_written"] == 1
    assert report["options"]["image"]["min_side"] == MIN_SIDE == 16
    assert [row["key"] for row in read_mds(tmp_path / "out")] == ["kept"]
    assert run_cli("folder", "--src", src, "--out", tmp_path / "all", "--min-side", "0") == 0
    assert sorted(row["key"] for row in read_mds(tmp_path / "all")) == sorted(sizes)


def test_min_side_must_not_be_negative(capsys):
    with pytest.raises(SystemExit) as exit_:
        parse_args(["folder", "--src", "x", "--out", "y", "--min-side", "-1"])
    assert exit_.value.code == 2 and "--min-side: must be at least 0, got -1" in capsys.readouterr().err


@pytest.mark.parametrize(
    "value, expected",
    [
        ("  a cat \n", "a cat"),
        (b"\xef\xbb\xbfa dog", "a dog"),  # UTF-8 with a byte-order mark
        (None, Skipped("", "missing_caption")),
        (math.nan, Skipped("", "missing_caption")),
        ("   ", Skipped("", "empty_caption")),
        (b"caf\xe9", Skipped("", "caption_not_utf8")),  # Latin-1
        ("bad \udcff", Skipped("", "caption_not_utf8")),  # what surrogateescape or a JSON "\udcff" gives
        (42, "42"),
    ],
)
def test_captions(value, expected):
    assert clean_caption(value) == expected


def test_long_captions_are_kept_whole_and_empty_ones_on_request():
    long = "word " * 5000
    assert clean_caption(long) == long.strip()
    assert clean_caption("", keep_empty=True) == ""


def test_filters_and_metadata_columns():
    columns = {**BASE_COLUMNS, **LAION_COLUMNS}
    raw = {
        "key": "k",
        "image": jpeg(),
        "caption": "c",
        "aesthetic": 6.0,
        "punsafe": "0.5",
        "similarity": None,
    }
    row, _ = prepare(raw, Options(min_aesthetic=5.0), columns)
    assert (
        row["aesthetic"] == 6.0
        and row["punsafe"] == 0.5
        and math.isnan(row["similarity"])
        and row["url"] == ""
    )
    assert prepare(raw, Options(min_aesthetic=6.5), columns) == Skipped("k", "filtered_aesthetic")
    assert prepare(raw, Options(max_punsafe=0.4), columns) == Skipped("k", "filtered_punsafe")
    assert prepare(raw, Options(min_similarity=0.2), columns) == Skipped("k", "missing_similarity")
    assert prepare({**raw, "image": None}, Options(), columns) == Skipped("k", "missing_image")


def test_buckets():
    buckets = (0.5, 1.0, 2.0)
    assert bucket_name(100, 100, buckets) == "ar1"
    assert bucket_name(300, 100, buckets) == "ar2"
    assert bucket_name(100, 180, buckets) == "ar0.5"
    assert bucket_name(100, 180, ()) == ""
