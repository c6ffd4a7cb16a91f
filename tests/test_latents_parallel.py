"""`sd-convert latents` at scale: several processes (--workers, composer -n 2) write what one does, a
SIGKILL midway loses nothing on rerun, a bucketed set keeps its buckets at their own sizes, S3 output."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from convert.encoders import load_encoders
from convert.latents import _pixels
from data.buckets import bucket_size
from tests.conftest import REPO, shared_folder
from tests.convert_fixtures import done_markers, encode, photo, read_mds, run_cli
from tests.s3_server import BUCKET, s3_server  # noqa: F401  (fixture)
from tests.test_convert_s3 import keys_under, s3_env  # noqa: F401  (fixtures)

# (width, height) by turns: buckets ar1.5, ar1 and ar0.75 (32x48 is nearest 0.75 of 0.75, 1, 1.5)
SHAPES = ((48, 32), (40, 40), (32, 48))
IMAGES, PART_SIZE, INPUTS = 96, 12, 8  # every input holds all three shapes
# tiny preset: sizes are multiples of 8 (VAE 4x times UNet 2x), latents 1/4 of the pixels
BUCKET_LATENTS = {"ar0.75": (8, 10, 6), "ar1": (8, 8, 8), "ar1.5": (8, 6, 10)}  # at 32 px
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="session")
def sources(tmp_path_factory) -> Path:
    """`plain/` and `bucketed/` (--buckets 0.75,1,1.5): the same 96 photos of three aspect ratios,
    converted by the folder source in 8 inputs of 12."""

    def build(root: Path) -> None:
        images = root / "images"
        images.mkdir()
        for i in range(IMAGES):
            width, height = SHAPES[i % 3]
            (images / f"{i:03d}.jpg").write_bytes(encode(photo(width, height, seed=i)))
            (images / f"{i:03d}.txt").write_text(f"photo {i}, {width}x{height}")
        argv = ["folder", "--src", images, "--part-size", PART_SIZE]
        assert run_cli(*argv, "--out", root / "plain") == 0
        assert run_cli(*argv, "--out", root / "bucketed", "--buckets", "0.75,1,1.5") == 0

    return shared_folder(tmp_path_factory, "latents-sources", build)


def argv(src, out, *extra, resolution: int = 32) -> list[str]:
    return ["latents", "--src", str(src), "--out", str(out), "--preset", "tiny", "--resolutions",
            str(resolution), *map(str, extra)]  # fmt: skip


def rows_of(local: Path, remote: str | None = None) -> list[tuple]:
    """Every row, every column, arrays as bytes: equal means bitwise equal."""
    return [
        tuple((k, v.tobytes() if isinstance(v, np.ndarray) else v) for k, v in sorted(row.items()))
        for row in read_mds(local, remote)
    ]


@pytest.fixture(scope="session")
def bucketed_latents(sources, tmp_path_factory) -> Path:
    """The bucketed set's latents at 32 px, written by --workers 2."""

    def build(out: Path) -> None:
        assert run_cli(*argv(sources / "bucketed", out / "latents", "--workers", 2)) == 0

    return shared_folder(tmp_path_factory, "bucketed-latents", build) / "latents"


@pytest.fixture(scope="session")
def plain_latents(sources, tmp_path_factory) -> Path:
    """The unbucketed set's latents at 32 px, written by one process."""

    def build(out: Path) -> None:
        assert run_cli(*argv(sources / "plain", out / "latents")) == 0

    return shared_folder(tmp_path_factory, "plain-latents", build) / "latents"


def check_mirrors_source(out: Path, src: Path) -> None:
    """The same inputs and completion markers as the source; a complete report."""
    assert sorted(p.name for p in (out / "_done").iterdir()) == sorted(
        p.name for p in (src / "_done").iterdir()
    )
    assert sorted(p.name for p in out.glob("part-*")) == [f"part-{i:05d}" for i in range(INPUTS)]
    report = json.loads((out / "convert-report.json").read_text())
    assert (report["complete"], report["inputs_done"], report["samples_written"]) == (True, INPUTS, IMAGES)


@pytest.mark.subprocess
def test_two_workers_write_what_one_process_does(sources, plain_latents, tmp_path):
    assert run_cli(*argv(sources / "plain", tmp_path / "two", "--workers", 2)) == 0
    one = rows_of(plain_latents)
    assert len(one) == IMAGES and len({dict(row)["key"] for row in one}) == IMAGES
    assert rows_of(tmp_path / "two") == one
    check_mirrors_source(plain_latents, sources / "plain")
    check_mirrors_source(tmp_path / "two", sources / "plain")


@pytest.mark.slow
def test_composer_two_ranks_write_what_one_process_does(sources, plain_latents, tmp_path):
    composer = Path(sys.executable).parent / "composer"
    cmd = [
        str(composer),
        "-n",
        "2",
        "-m",
        "convert",
        *argv(sources / "plain", tmp_path / "ranks"),
        "--no-progress",
    ]
    ranks = subprocess.run(cmd, cwd=REPO, env=ENV, capture_output=True, text=True, timeout=300)
    assert ranks.returncode == 0, ranks.stdout[-2000:] + ranks.stderr[-3000:]
    assert "8 to convert (4 by rank 0 of 2)" in ranks.stderr  # rank 0 took half, rank 1 the rest
    assert rows_of(tmp_path / "ranks") == rows_of(plain_latents)
    check_mirrors_source(tmp_path / "ranks", sources / "plain")


def _alive(pgid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[-1].split()  # state, ppid, pgrp, ...
        if entry.name.isdigit() and fields[0] != "Z" and int(fields[2]) == pgid:
            found.append(int(entry.name))
    return found


@pytest.mark.slow
def test_sigkill_midway_then_rerun_equals_a_clean_run(sources, tmp_path):
    src, out, clean = sources / "bucketed", tmp_path / "out", tmp_path / "clean"
    run = argv(src, out, "--workers", 2, resolution=128)  # 128 px: slow enough to kill midway
    proc = subprocess.Popen(
        [sys.executable, "-m", "convert", *run, "--no-progress"],
        cwd=REPO, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True,
    )  # fmt: skip
    deadline = time.monotonic() + 120
    while not done_markers(out) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.005)
    assert proc.poll() is None, f"ended before it could be killed: {proc.stderr.read().decode()[-2000:]}"
    os.killpg(proc.pid, signal.SIGKILL)  # the parent and its workers, at once
    proc.wait()
    proc.stderr.close()
    for _ in range(200):
        if not _alive(proc.pid):
            break
        time.sleep(0.01)
    else:
        pytest.fail(f"processes {_alive(proc.pid)} outlived the kill")
    done_before = len(done_markers(out))
    assert 0 < done_before < INPUTS and not (out / "index.json").exists()

    assert run_cli(*run) == 0
    report = json.loads((out / "convert-report.json").read_text())
    assert (report["inputs_done"], report["inputs_done_this_run"]) == (INPUTS, INPUTS - done_before)
    assert run_cli(*argv(src, clean, resolution=128)) == 0
    rows = rows_of(out)
    assert len(rows) == IMAGES and rows == rows_of(clean)


@pytest.mark.subprocess
def test_buckets_are_kept_each_at_its_own_size(sources, bucketed_latents):
    src, out = sources / "bucketed", bucketed_latents
    folders = sorted(p.relative_to(src) for p in src.glob("ar*/part-*"))
    assert len(folders) == 3 * INPUTS
    assert sorted(p.relative_to(out) for p in out.glob("ar*/part-*")) == folders
    report = json.loads((out / "convert-report.json").read_text())
    assert report["buckets"] == {"ar0.75": 32, "ar1": 32, "ar1.5": 32}
    model = load_encoders("tiny")
    for label, shape in BUCKET_LATENTS.items():
        rows, source = read_mds(out / label), read_mds(src / label)  # each bucket's own index.json
        assert [r["key"] for r in rows] == [s["key"] for s in source]
        assert {r["latents_32"].shape for r in rows} == {shape}
        height, width = bucket_size(float(label[2:]), 32, 8)
        assert (height // 4, width // 4) == shape[1:]
        pixels = _pixels(source[7]["image"], height, width)
        expected = model.vae_moments(pixels[None])[0].detach().half().numpy()
        np.testing.assert_allclose(rows[7]["latents_32"], expected, rtol=1e-2, atol=1e-3)
    assert len(read_mds(out)) == IMAGES  # the merged top-level index


def test_s3_output(s3_env, sources, bucketed_latents, tmp_path):  # noqa: F811
    out = f"s3://{BUCKET}/latents"
    run = argv(sources / "bucketed", out, "--workers", 2, "--work-dir", tmp_path / "work")
    assert run_cli(*run) == 0
    assert rows_of(tmp_path / "cache", remote=out) == rows_of(bucketed_latents)
    assert len(read_mds(tmp_path / "cache-ar1", remote=f"{out}/ar1")) == 32
    stored = set(keys_under(s3_env, "latents/"))
    assert {"index.json", "ar0.75/index.json", "convert-report.json", "_done/part-00007.json"} <= stored
    assert "ar1.5/part-00003/shard.00000.mds" in stored
    assert not (tmp_path / "work").exists()  # staged, uploaded, cleaned up

    assert run_cli(*run) == 0  # a rerun finds every input finished, on S3
    body = s3_env.client().get_object(Bucket=BUCKET, Key="latents/convert-report.json")["Body"].read()
    report = json.loads(body)
    assert (report["inputs_done"], report["inputs_done_this_run"], report["samples_written"]) == (8, 0, 96)


def test_an_image_that_does_not_decode_is_skipped(tmp_path):
    from convert.common import BASE_COLUMNS
    from convert.mds import write_mds

    good = [encode(photo(40, 32, seed=i)) for i in range(3)]
    rows = [
        {"image": data, "caption": f"c{i}", "width": 40, "height": 32, "key": f"k{i}"}
        | {"original_width": 40, "original_height": 32}
        for i, data in enumerate(good)
    ]
    rows[1]["image"] = good[1][: len(good[1]) // 2]  # truncated after the source's header check
    write_mds(rows, str(tmp_path / "src"), BASE_COLUMNS)
    assert run_cli(*argv(tmp_path / "src", tmp_path / "out")) == 0
    report = json.loads((tmp_path / "out" / "convert-report.json").read_text())
    assert (report["samples_written"], report["samples_skipped"]) == (2, {"corrupt_image": 1})
    assert [row["key"] for row in read_mds(tmp_path / "out")] == ["k0", "k2"]
