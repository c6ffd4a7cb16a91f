"""One output holds one conversion: a rerun continues it, another conversion is refused (or, with
--overwrite, replaces it and nothing else), and a folder of unrelated files is refused."""

import json
from pathlib import Path

from tests.convert_fixtures import jpeg, make_i2d_tars, read_mds, run_cli


def photo_folder(src: Path, count: int, seed: int) -> dict[str, str]:
    """`count` captioned photos; returns key -> caption."""
    src.mkdir(parents=True)
    for i in range(count):
        (src / f"{seed}-{i}.jpg").write_bytes(jpeg(24 + i, 16, seed=seed * 100 + i))
        (src / f"{seed}-{i}.txt").write_text(f"photo {i} of set {seed}")
    return {f"{seed}-{i}": f"photo {i} of set {seed}" for i in range(count)}


def captions(out: Path) -> dict[str, str]:
    return {row["key"]: row["caption"] for row in read_mds(out)}


def error_line(capsys, *argv) -> str:
    assert run_cli(*argv) == 1
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("sd-convert: error: "), lines
    return lines[0]


def test_another_source_is_refused_and_overwrite_replaces_only_that_conversion(tmp_path, capsys):
    a, b, out = tmp_path / "a", tmp_path / "b", tmp_path / "out"
    first, second = photo_folder(a, 5, seed=1), photo_folder(b, 3, seed=2)
    assert run_cli("folder", "--src", a, "--out", out, "--part-size", "2", "--buckets", "1,1.5") == 0
    assert captions(out) == first
    report = (out / "convert-report.json").read_bytes()
    (out / "NOTES.md").write_text("the user's own file")  # added after the conversion: not refused

    line = error_line(capsys, "folder", "--src", b, "--out", out, "--part-size", "2", "--buckets", "1,1.5")
    assert f"folder --src {a} --part-size 2" in line and f"folder --src {b} --part-size 2" in line
    assert "new --out" in line and "--overwrite" in line
    assert captions(out) == first and (out / "convert-report.json").read_bytes() == report

    line = error_line(capsys, "img2dataset", "--src", b, "--out", out)  # another source kind
    assert f"folder --src {a}" in line and f"img2dataset --src {b}" in line
    line = error_line(capsys, "folder", "--src", a, "--out", out, "--part-size", "3", "--buckets", "1,1.5")
    assert "--part-size 2`" in line and "--part-size 3`" in line  # cut into other inputs
    line = error_line(capsys, "folder", "--src", a, "--out", out, "--part-size", "2", "--resize-max", "8")
    assert "other options" in line and "resize_max None there, 8 now" in line and "buckets" in line

    assert run_cli("folder", "--src", b, "--out", out, "--overwrite") == 0
    assert captions(out) == second
    # A's three inputs in two buckets are gone, B's one input without buckets is there
    assert sorted(p.name for p in out.iterdir() if not p.name.startswith(".")) == [
        "NOTES.md", "_done", "convert-report.json", "index.json", "part-00000", "sd-convert.json"
    ]  # fmt: skip
    assert (out / "NOTES.md").read_text() == "the user's own file"
    report = json.loads((out / "convert-report.json").read_text())
    assert (report["inputs_done"], report["samples_written"]) == (1, 3)


def test_the_same_conversion_continues_from_another_working_directory(tmp_path, monkeypatch):
    src, out = tmp_path / "shards", tmp_path / "out"
    make_i2d_tars(src, shards=3, per_shard=2)
    assert run_cli("img2dataset", "--src", src, "--out", out) == 0
    (out / "_done" / "00001.json").unlink()  # as if killed before input 00001 was finished
    monkeypatch.chdir(tmp_path)
    assert run_cli("img2dataset", "--src", "shards", "--out", "out") == 0
    report = json.loads((out / "convert-report.json").read_text())
    assert (report["inputs_done"], report["inputs_done_this_run"], report["samples_written"]) == (3, 1, 6)


def test_a_folder_of_unrelated_files_is_refused(tmp_path, capsys):
    src, out = tmp_path / "images", tmp_path / "photos"
    photo_folder(src, 2, seed=3)
    out.mkdir()
    (out / "holiday.jpg").write_bytes(b"the user's photo")
    for extra in ([], ["--overwrite"]):
        line = error_line(capsys, "folder", "--src", src, "--out", out, *extra)
        assert f"--out {out} holds files that sd-convert did not write (holiday.jpg)" in line
    assert sorted(p.name for p in out.iterdir() if not p.name.startswith(".")) == ["holiday.jpg"]

    hidden = tmp_path / "hidden"
    hidden.mkdir()
    (hidden / ".DS_Store").write_bytes(b"\0")  # hidden files say nothing about whose folder it is
    assert run_cli("folder", "--src", src, "--out", hidden) == 0


def test_an_output_from_before_the_record_is_adopted(tmp_path, capsys):
    a, b, out = tmp_path / "a", tmp_path / "b", tmp_path / "out"
    first = photo_folder(a, 4, seed=4)
    photo_folder(b, 2, seed=5)
    assert run_cli("folder", "--src", a, "--out", out, "--part-size", "2") == 0
    (out / "sd-convert.json").unlink(missing_ok=True)  # what an older sd-convert left: markers, a report
    (out / "_done" / "part-00001.json").unlink()

    line = error_line(capsys, "folder", "--src", b, "--out", out, "--part-size", "2")
    assert f"folder --src {a}" in line and f"folder --src {b}" in line
    assert run_cli("folder", "--src", a, "--out", out, "--part-size", "2") == 0
    assert captions(out) == first
    assert json.loads((out / "sd-convert.json").read_text())["src"] == str(a)
