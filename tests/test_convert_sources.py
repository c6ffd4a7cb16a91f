"""`sd-convert folder` and `coco`, fatal errors, and the help texts."""

import json
import subprocess
import sys

import pytest

from convert.cli import build_parser, parse_args
from tests.conftest import REPO
from tests.convert_fixtures import close, encode, jpeg, photo, pixels, read_mds, repairable_images, run_cli


@pytest.mark.subprocess
def test_folder(tmp_path):
    src, out = tmp_path / "images", tmp_path / "out"
    (src / "sub").mkdir(parents=True)
    expected = {}
    for i in range(5):
        data = jpeg(20 + i, 20, seed=i)
        (src / f"{i:02d}.jpg").write_bytes(data)
        (src / f"{i:02d}.txt").write_text(f"caption {i}")
        expected[f"{i:02d}"] = (data, f"caption {i}")
    png = encode(photo(16, 16), "PNG")
    (src / "sub" / "j.png").write_bytes(png)
    (src / "sub" / "j.json").write_text(json.dumps({"caption": "from json", "similarity": 0.3}))
    expected["sub/j"] = (png, "from json")
    grey16, pixels16, _ = repairable_images()["grey16"]
    (src / "sub" / "g.png").write_bytes(grey16)
    (src / "sub" / "g.txt").write_text("sixteen bit")
    (src / "empty.jpg").write_bytes(b"")
    (src / "empty.txt").write_text("zero bytes")
    (src / "fake.png").write_text("not a png")
    (src / "fake.txt").write_text("fake")
    (src / "nocaption.jpg").write_bytes(jpeg())
    (src / "latin1.jpg").write_bytes(jpeg())
    (src / "latin1.txt").write_bytes("\xe9t\xe9".encode("latin-1"))
    (src / "badjson.jpg").write_bytes(jpeg())
    (src / "badjson.json").write_text("{not json")
    assert run_cli("folder", "--src", src, "--out", out, "--part-size", "4", "--workers", "2") == 0

    rows = read_mds(out)
    assert [r["key"] for r in rows] == [*sorted(expected)[:5], "sub/g", "sub/j"]  # sorted path order
    for row in rows:
        if row["key"] == "sub/g":
            assert row["caption"] == "sixteen bit" and close(pixels(row["image"]), pixels16, tol=1.0)
        else:
            assert (row["image"], row["caption"]) == expected[row["key"]]
    report = json.loads((out / "convert-report.json").read_text())
    assert report["inputs_total"] == 3  # 12 images in parts of 4
    assert report["samples_skipped"] == {
        "bad_json": 1, "caption_not_utf8": 1, "empty_file": 1, "missing_caption": 1, "not_an_image": 1
    }  # fmt: skip
    assert report["samples_repaired"] == {"16bit": 1}


def coco_layout(root):
    images = root / "val2014"
    images.mkdir(parents=True)
    entries, annotations, expected = [], [], {}
    for i, image_id in enumerate([42, 7, 19]):
        name = f"COCO_val2014_{image_id:012d}.jpg"
        data = jpeg(30, 20, seed=image_id)
        (images / name).write_bytes(data)
        entries.append({"id": image_id, "file_name": name, "width": 30, "height": 20})
        caps = [f"caption {c} of image {image_id} " for c in range(3)]
        for c, text in enumerate(caps):  # annotation ids out of order on purpose
            annotations.append({"image_id": image_id, "id": 1000 * (3 - c) + i, "caption": text})
        expected[image_id] = (data, [t.strip() for t in reversed(caps)])
    entries.append({"id": 99, "file_name": "COCO_val2014_000000000099.jpg"})  # listed, file missing
    entries.append({"id": 100, "file_name": "../../etc/passwd"})
    annotations.append({"image_id": 99, "id": 5, "caption": "lost"})
    annotations.append({"image_id": 100, "id": 6, "caption": "escape"})
    ann = root / "annotations" / "captions_val2014.json"
    ann.parent.mkdir()
    ann.write_text(json.dumps({"images": entries, "annotations": annotations}))
    return ann, images, expected


def test_coco_one_row_per_image_and_per_caption(tmp_path):
    ann, images, expected = coco_layout(tmp_path / "coco")
    assert run_cli("coco", "--src", ann, "--images", images, "--out", tmp_path / "per_image") == 0
    rows = read_mds(tmp_path / "per_image")
    assert [r["image_id"] for r in rows] == [7, 19, 42]
    for row in rows:
        data, captions = expected[row["image_id"]]
        assert row["image"] == data and row["key"] == str(row["image_id"])
        assert json.loads(row["captions"]) == captions and row["caption"] == captions[0]
    report = json.loads((tmp_path / "per_image" / "convert-report.json").read_text())
    assert report["samples_skipped"] == {"missing_image": 1, "unsafe_path": 1}

    assert (
        run_cli("coco", "--src", ann, "--images", images, "--out", tmp_path / "per_cap", "--per-caption") == 0
    )
    rows = read_mds(tmp_path / "per_cap")
    assert len(rows) == 9
    assert [r["caption"] for r in rows[:3]] == expected[7][1]
    assert {r["key"] for r in rows[:3]} == {"7_1001", "7_2001", "7_3001"}


def fatal(capsys, *argv) -> str:
    assert run_cli(*argv) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("sd-convert: error: ")
    return err[0]


def test_fatal_errors_name_what_and_where(tmp_path, capsys):
    missing = tmp_path / "nowhere"
    assert str(missing) in fatal(capsys, "folder", "--src", missing, "--out", tmp_path / "o1")
    assert str(missing) in fatal(capsys, "img2dataset", "--src", missing, "--out", tmp_path / "o2")
    assert "no img2dataset shards" in fatal(
        capsys, "img2dataset", "--src", tmp_path, "--out", tmp_path / "o3"
    )
    blocker = tmp_path / "file"
    blocker.write_text("x")
    (tmp_path / "imgs").mkdir()
    (tmp_path / "imgs" / "a.jpg").write_bytes(jpeg())
    line = fatal(capsys, "folder", "--src", tmp_path / "imgs", "--out", blocker / "out")
    assert "cannot write" in line and str(blocker) in line
    (tmp_path / "bad.json").write_text("{}")
    line = fatal(
        capsys, "coco", "--src", tmp_path / "bad.json", "--images", tmp_path, "--out", tmp_path / "o4"
    )
    assert "not a COCO captions json" in line
    assert not any((tmp_path / o).exists() for o in ("o1", "o2", "o3", "o4"))  # nothing half-written


@pytest.mark.subprocess
def test_every_option_is_explained():
    parser = build_parser()
    subparsers = next(a for a in parser._actions if a.choices and isinstance(a.choices, dict)).choices
    assert sorted(subparsers) == [
        "coco",
        "folder",
        "img2dataset",
        "laion",
        "latents",
        "mlperf-flux",
        "mlperf-flux-images",
    ]
    for name, sub in subparsers.items():
        text = sub.format_help()
        for action in sub._actions:
            assert action.help and len(action.help) > 10, (name, action.option_strings)
            assert action.option_strings[-1] in text
    result = subprocess.run(
        [sys.executable, "-m", "convert", "--help"], cwd=REPO, capture_output=True, text=True
    )
    assert result.returncode == 0 and all(name in result.stdout for name in subparsers)


def test_bad_option_combinations_are_refused(capsys):
    for extra in (["--center-crop", "--buckets", "1,2"], ["--buckets", "1,x"], ["--workers", "0"]):
        with pytest.raises(SystemExit):
            parse_args(["folder", "--src", "x", "--out", "y", *extra])
