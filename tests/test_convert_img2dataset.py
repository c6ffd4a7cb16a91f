"""`sd-convert img2dataset`: webdataset tars and parquet shards full of bad samples, read back exactly."""

import json
import math
import tarfile

import numpy as np
import pytest

from tests.convert_fixtures import (
    close,
    hostile_images,
    i2d_json,
    jpeg,
    make_i2d_tars,
    pixels,
    read_mds,
    repairable_images,
    run_cli,
    sample_members,
    write_parquet,
    write_stats,
    write_tar,
)


def hostile_tar(folder):
    """Shard 00000: 4 good samples among every kind of bad one; returns (good, repaired, reasons)."""
    good, members = {}, []
    for i in range(4):
        key, image, caption = f"good{i}", jpeg(40, 30, seed=i), f"a good photo number {i}"
        members += sample_members(
            key, image, caption, similarity=0.31, punsafe=0.02, pwatermark=0.1, AESTHETIC_SCORE=6
        )
        good[key] = (image, caption)
    long_caption = "a very long caption " * 400
    members += sample_members("long", jpeg(seed=9), long_caption)
    good["long"] = (jpeg(seed=9), long_caption.strip())
    for name, (data, _) in hostile_images().items():
        members += sample_members(name, data, f"caption of {name}")
    members += sample_members("empty_caption", jpeg(), "")
    members += sample_members("null_caption", jpeg(), None)
    members += [("nan_caption.jpg", jpeg()), ("nan_caption.json", b'{"caption": NaN, "key": "nan_caption"}')]
    members += [("latin1.jpg", jpeg()), ("latin1.txt", "caf\xe9".encode("latin-1")), ("latin1.json", b"{}")]
    members += [("nojson.jpg", jpeg()), ("nojson.txt", b"a caption without its json")]
    members += [("noimage.txt", b"a caption"), ("noimage.json", i2d_json("noimage", "a caption"))]
    members += [("../escape.jpg", jpeg()), ("/tmp/sd-convert-abs-escape.txt", b"x")]
    link = tarfile.TarInfo("link.jpg")
    link.type, link.linkname = tarfile.SYMTYPE, "/etc/passwd"
    members.append((link, None))
    write_tar(folder / "00000.tar", members)
    write_stats(folder, "00000", len(members))
    # the rows parquet img2dataset writes beside each tar also lists the downloads that failed
    write_parquet(
        folder / "00000.parquet",
        [{"key": "f1", "status": "failed_to_download"}, {"key": "good0", "status": "success"}],
    )

    repaired, members = {}, []
    for name, (data, expected, reason) in repairable_images().items():
        members += sample_members(
            name, data, f"repair {name}", ext="png" if data[:4] == b"\x89PNG" else "jpg"
        )
        repaired[name] = (expected, reason)
    write_tar(folder / "00001.tar", members)
    write_stats(folder, "00001", len(members))
    reasons = {
        "truncated_image": 1,
        "empty_file": 1,
        "not_an_image": 1,
        "too_many_pixels": 1,
        "empty_caption": 1,
        "missing_caption": 2,
        "caption_not_utf8": 1,
        "missing_json": 1,
        "missing_image": 1,
        "unsafe_path": 2,
        "not_a_file": 1,
        "failed_to_download": 1,
    }
    return good, repaired, reasons


def test_webdataset_shards_with_bad_samples(tmp_path):
    src, out = tmp_path / "shards", tmp_path / "out"
    src.mkdir()
    good, repaired, reasons = hostile_tar(src)
    write_tar(
        src / "00002.tar", sample_members("unfinished", jpeg(), "still downloading")
    )  # no _stats.json yet
    assert run_cli("img2dataset", "--src", src, "--out", out, "--work-dir", tmp_path / "work") == 0

    rows = {row["key"]: row for row in read_mds(out)}
    assert sorted(rows) == sorted([*good, *repaired])
    for key, (image, caption) in good.items():
        assert rows[key]["image"] == image  # original bytes, untouched
        assert rows[key]["caption"] == caption
    assert (rows["good1"]["width"], rows["good1"]["height"]) == (40, 30)
    assert rows["good1"]["similarity"] == 0.31 and rows["good1"]["aesthetic"] == 6.0
    assert rows["good1"]["url"] == "http://example.invalid/good1.jpg"
    assert math.isnan(rows["long"]["punsafe"])  # absent from its json
    for key, (expected, _) in repaired.items():
        assert close(pixels(rows[key]["image"]), expected, tol=6.0), key
        assert (rows[key]["width"], rows[key]["height"]) == expected.shape[1::-1]

    report = json.loads((out / "convert-report.json").read_text())
    assert report["samples_skipped"] == dict(sorted(reasons.items()))
    assert report["samples_repaired"] == {"16bit": 1, "cmyk": 1, "exif_orientation": 1, "transparency": 2}
    assert report["samples_written"] == len(good) + len(repaired)
    assert (report["inputs_total"], report["inputs_done"], report["complete"]) == (2, 2, True)
    # the tar's hostile names were never paths: nothing appeared outside (or inside) the output
    assert not (tmp_path / "escape.jpg").exists() and not (src.parent / "escape.jpg").exists()
    assert not any("escape" in p.name or p.is_symlink() for p in tmp_path.rglob("*"))


def test_parquet_shards_auto_detected(tmp_path):
    src, out = tmp_path / "shards", tmp_path / "out"
    src.mkdir()
    images = [jpeg(30 + i, 20, seed=i) for i in range(5)]
    rows = [
        {
            "key": "p0",
            "jpg": images[0],
            "txt": "zero",
            "caption": "zero",
            "width": 30,
            "height": 20,
            "status": "success",
        },
        {
            "key": "p1",
            "jpg": images[1],
            "txt": "one",
            "caption": "one",
            "width": None,
            "height": None,
            "status": "success",
        },
        {
            "key": "p2",
            "jpg": None,
            "txt": None,
            "caption": "two",
            "width": None,
            "height": None,
            "status": "failed_to_download",
        },
        {
            "key": "p3",
            "jpg": images[3],
            "txt": "nan",
            "caption": None,
            "width": 33,
            "height": 20,
            "status": "success",
        },
        {
            "key": "p4",
            "jpg": b"\xff\xd8\xff\xe0 truncated",
            "txt": "four",
            "caption": "four",
            "width": 34,
            "height": 20,
            "status": "success",
        },
    ]
    for row in rows:
        row.update(
            similarity=0.25,
            punsafe=0.5,
            pwatermark=0.75,
            AESTHETIC_SCORE=4.5,
            url=f"http://x.invalid/{row['key']}",
        )
    write_parquet(src / "00000.parquet", rows)
    (src / "broken.parquet").write_bytes(b"PAR1 this is not a parquet file")
    assert run_cli("img2dataset", "--src", src, "--out", out) == 0

    back = {row["key"]: row for row in read_mds(out)}
    assert sorted(back) == ["p0", "p1"]
    assert back["p1"]["image"] == images[1] and back["p1"]["caption"] == "one"
    assert (back["p1"]["width"], back["p1"]["height"]) == (31, 20)  # measured: the row's size was null
    assert (back["p0"]["punsafe"], back["p0"]["pwatermark"], back["p0"]["aesthetic"]) == (0.5, 0.75, 4.5)
    report = json.loads((out / "convert-report.json").read_text())
    expected = {"corrupt_parquet": 1, "failed_to_download": 1, "missing_caption": 1, "not_an_image": 1}
    assert report["samples_skipped"] == expected


def test_filters(tmp_path):
    src, out = tmp_path / "shards", tmp_path / "out"
    make_i2d_tars(src, shards=1, per_shard=20, size=(24, 24))  # similarity 0.300 .. 0.319
    with tarfile.open(src / "00000.tar") as tar:
        assert len(tar.getnames()) == 60
    argv = ["img2dataset", "--src", src, "--out", out, "--min-similarity", "0.31", "--max-punsafe", "0.5"]
    assert run_cli(*argv, "--min-aesthetic", "5", "--max-watermark", "0.5", "--min-side", "16") == 0
    report = json.loads((out / "convert-report.json").read_text())
    assert report["samples_written"] == 10 and report["samples_skipped"] == {"filtered_similarity": 10}
    # 24 px is below --min-side 32: the ten that pass the similarity filter are all skipped, so nothing
    # is written and the run exits 1, with every skip counted
    assert run_cli(*argv, "--min-side", "32", "--out", tmp_path / "out2") == 1
    report = json.loads((tmp_path / "out2" / "convert-report.json").read_text())
    assert report["samples_skipped"] == {"filtered_min_side": 10, "filtered_similarity": 10}


@pytest.mark.parametrize("center_crop", [False, True])
def test_resize_and_buckets(tmp_path, center_crop):
    src, out = tmp_path / "shards", tmp_path / "out"
    src.mkdir()
    sizes = [(64, 32), (32, 64), (48, 48), (60, 40), (40, 60), (100, 30)]
    members = []
    for i, (w, h) in enumerate(sizes):
        members += sample_members(f"s{i}", jpeg(w, h, seed=i), f"size {w}x{h}")
    write_tar(src / "00000.tar", members)
    extra = ["--center-crop"] if center_crop else ["--buckets", "0.5,1,2"]
    assert run_cli("img2dataset", "--src", src, "--out", out, "--resize-max", "16", *extra) == 0

    rows = {row["key"]: row for row in read_mds(out)}
    assert len(rows) == len(sizes)
    for i, (w, h) in enumerate(sizes):
        row, scale = rows[f"s{i}"], 16 / min(w, h)
        expected = (16, 16) if center_crop else (round(w * scale), round(h * scale))
        assert (row["width"], row["height"]) == expected == pixels(row["image"]).shape[1::-1]
        assert row["caption"] == f"size {w}x{h}"
        if not center_crop:
            from PIL import Image

            reference = Image.open(__import__("io").BytesIO(jpeg(w, h, seed=i))).resize(
                expected, Image.LANCZOS
            )
            assert close(pixels(row["image"]), np.asarray(reference, dtype=np.float64), tol=6.0)
    if not center_crop:
        per_bucket = {b: [r["key"] for r in read_mds(out / b)] for b in ("ar0.5", "ar1", "ar2")}
        assert per_bucket == {"ar0.5": ["s1", "s4"], "ar1": ["s2"], "ar2": ["s0", "s3", "s5"]}
        report = json.loads((out / "convert-report.json").read_text())
        assert report["buckets"] == {"ar0.5": 2, "ar1": 1, "ar2": 3}
