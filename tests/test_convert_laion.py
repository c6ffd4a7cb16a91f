"""`sd-convert laion`: metadata parquet -> img2dataset downloads from a loopback HTTP server -> MDS."""

import json
import math

import pytest

from tests.convert_fixtures import (
    close,
    encode,
    hostile_images,
    jpeg,
    photo,
    pixels,
    read_mds,
    repairable_images,
    run_cli,
    serve_folder,
    write_parquet,
)


@pytest.mark.slow
def test_laion_metadata_to_mds(tmp_path, capsys):
    www, out, work = tmp_path / "www", tmp_path / "out", tmp_path / "work"
    www.mkdir()
    files = {f"good{i}.jpg": jpeg(40 + i, 30, seed=i) for i in range(5)}
    files["photo.png"] = encode(photo(20, 20, seed=8), "PNG")
    files["palette.png"] = repairable_images()["palette_transparent"][0]
    files["truncated.jpg"] = hostile_images()["truncated_jpeg"][0]
    files["page.jpg"] = hostile_images()["not_an_image"][0]
    for name, data in files.items():
        (www / name).write_bytes(data)

    with serve_folder(www) as base:
        rows = [{"URL": f"{base}/{name}", "TEXT": f"caption for {name}"} for name in files]
        rows.append({"URL": f"{base}/missing.jpg", "TEXT": "a 404"})
        rows[1]["TEXT"] = None  # null caption
        for i, row in enumerate(rows):
            row.update(
                WIDTH=None if i % 2 else 40,
                HEIGHT=None if i % 3 else 30,
                similarity=0.3 + i / 100,
                punsafe=None if i == 2 else 0.01,
                pwatermark=0.1,
                AESTHETIC_SCORE=5.0 + i / 10,
            )
        meta = write_parquet(tmp_path / "laion-meta.parquet", rows)
        argv = ["laion", "--src", meta, "--out", out, "--work-dir", work, "--threads", "4", "--timeout", "5"]
        assert run_cli(*argv) == 0

    by_url = {row["URL"]: row for row in rows}
    written = read_mds(out)
    assert {r["url"].rsplit("/", 1)[1] for r in written} == {
        "good0.jpg",
        "good2.jpg",
        "good3.jpg",
        "good4.jpg",
        "photo.png",
        "palette.png",
    }
    for row in written:
        name, source = row["url"].rsplit("/", 1)[1], by_url[row["url"]]
        assert row["caption"] == source["TEXT"]
        assert row["similarity"] == source["similarity"] and row["aesthetic"] == source["AESTHETIC_SCORE"]
        assert row["pwatermark"] == 0.1
        if source["punsafe"] is None:
            assert math.isnan(row["punsafe"])
        else:
            assert row["punsafe"] == source["punsafe"]
        if name == "palette.png":  # repaired: transparency composited on white
            assert close(pixels(row["image"]), repairable_images()["palette_transparent"][1], tol=1.0)
        else:
            assert row["image"] == files[name]  # the bytes as served, untouched by img2dataset or by us
    report = json.loads((out / "convert-report.json").read_text())
    assert report["samples_skipped"] == {
        "failed_to_download": 1,
        "missing_caption": 1,
        "not_an_image": 1,
        "truncated_image": 1,
    }
    assert report["samples_repaired"] == {"transparency": 1} and report["complete"]
    assert "inputs done" in capsys.readouterr().out

    # the downloads are kept for a rerun, which has nothing left to do
    assert (work / "downloads" / "00000.tar").exists()
    assert run_cli(*argv, "--delete-downloads") == 0
    report = json.loads((out / "convert-report.json").read_text())
    assert report["inputs_done_this_run"] == 0 and report["samples_written"] == 6
    assert not (work / "downloads").exists()


def test_laion_needs_url_and_caption_columns(tmp_path, capsys):
    meta = write_parquet(tmp_path / "m.parquet", [{"link": "http://127.0.0.1:9/x.jpg", "TEXT": "x"}])
    assert run_cli("laion", "--src", meta, "--out", tmp_path / "out", "--work-dir", tmp_path / "w") == 1
    line = capsys.readouterr().err.strip()
    assert "no URL column" in line and "--url-col" in line and str(meta) in line
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_overwrite_with_another_source_downloads_that_source(tmp_path):
    """The default work dir is named after --out, so two sources' downloads meet in one folder: the
    second one's (same shard count) must not be taken from the first one's."""
    www, out, work = tmp_path / "www", tmp_path / "out", tmp_path / "work"
    www.mkdir()
    for name in ("a.jpg", "b.jpg"):
        (www / name).write_bytes(jpeg(32, 24, seed=len(name) + ord(name[0])))
    with serve_folder(www) as base:
        for name in ("a", "b"):
            rows = [{"URL": f"{base}/{name}.jpg", "TEXT": f"photo {name}"}]
            meta = write_parquet(tmp_path / f"{name}.parquet", rows)
            argv = ["laion", "--src", meta, "--out", out, "--work-dir", work, "--threads", "1", "--overwrite"]
            assert run_cli(*argv) == 0
            assert [r["caption"] for r in read_mds(out)] == [f"photo {name}"]
