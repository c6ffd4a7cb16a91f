"""A user's mistakes with evaluation.evaluate and sd-convert (issue 37; the helpers and the rest in
tests/test_cli_mistakes.py): too few images refused before any sampling, small counts marked, and
conversions that made nothing exit non-zero; nothing of the user's is changed."""

import json
import math
from pathlib import Path

import pytest
import torch

from convert.__main__ import main as sd_convert
from evaluation import evaluate, extractors
from evaluation.image_metrics import MIN_IMAGES, fid, kid, markdown, scores, small_n
from tests.test_cli_mistakes import nothing_loads, one_line_exit, snapshot  # noqa: F401 (a fixture)

# --- evaluation.evaluate --------------------------------------------------------------------------


def eval_args(source, data, out, *more) -> list[str]:
    return [str(source), "--data", str(data), "--out", str(out), "--extractors", "tiny", *more]


@pytest.mark.parametrize(
    "flags, says",
    [
        (["--num-captions", "2"], "--num-captions 2: FID and KID need at least 10 images per guidance scale"),
        (["--guidance", "3", "-1"], "--guidance -1: guidance scales must be finite and >= 0"),
        (["--steps", "0"], "--steps 0: must be at least 1"),
        (["--batch-size", "0"], "--batch-size 0: must be at least 1"),
        (["--resolution", "0"], "--resolution 0: must be at least 1"),
        (["--guidance-rescale", "-0.1"], "--guidance-rescale -0.1: must be between 0 and 1"),
    ],
)
@pytest.mark.usefixtures("nothing_loads")
def test_evaluate_numbers_before_anything_loads(flags, says, shapes_mds, tmp_path, monkeypatch):
    monkeypatch.setattr(evaluate, "open_dataset", lambda args: pytest.fail("the data set was opened"))
    argv = eval_args(tmp_path / "ckpt.pt", shapes_mds / "mds", tmp_path / "out", *flags)
    message = one_line_exit(evaluate.main, argv)
    assert message.startswith(f"python -m evaluation.evaluate: error: {says}"), message
    assert "--num-captions 10 or more" in message if "captions" in says else True
    assert not (tmp_path / "out").exists()


@pytest.fixture(scope="module")
def six_rows(tmp_path_factory) -> Path:
    """An MDS image-caption set of 6 rows: fewer than FID and KID need."""
    from convert.folder import iter_samples
    from convert.mds import write_mds
    from data.synthetic import write_shapes_folder

    root = tmp_path_factory.mktemp("six")
    write_shapes_folder(root / "images", n=6, size=32, seed=0)
    write_mds(iter_samples(root / "images"), str(root / "mds"))
    return root / "mds"


@pytest.mark.usefixtures("nothing_loads")
def test_evaluate_a_set_too_small_before_any_sampling(six_rows, tiny_pipeline, tmp_path):
    folder, _ = tiny_pipeline
    message = one_line_exit(
        evaluate.main, eval_args(folder, six_rows, tmp_path / "out", "--num-captions", "24")
    )
    assert message.startswith(
        f"python -m evaluation.evaluate: error: --data {six_rows} has 6 rows: FID and KID"
    )
    assert not (tmp_path / "out" / "images").exists()


@pytest.mark.heavy
def test_evaluate_a_resolution_the_vae_would_round(shapes_mds, tiny_pipeline, tmp_path, monkeypatch):
    folder, _ = tiny_pipeline
    monkeypatch.setattr(extractors, "inception", lambda *a: object())  # never used: refused first
    monkeypatch.setattr(extractors, "clip", lambda *a: object())
    monkeypatch.setattr(evaluate, "real_features", lambda *a: pytest.fail("evaluated before the check"))
    argv = eval_args(
        folder, shapes_mds / "mds", tmp_path / "out", "--resolution", "30", "--num-captions", "10"
    )
    message = one_line_exit(evaluate.main, argv)
    assert message.endswith(
        "--resolution 30: must be a multiple of 4 (the VAE's factor 4); the nearest valid sizes: 28 or 32"
    )
    assert not (tmp_path / "out" / "images").exists()


def test_small_image_counts_are_refused_or_marked():
    torch.manual_seed(0)
    real, fake = torch.randn(12, 64, dtype=torch.float64), torch.randn(12, 64, dtype=torch.float64) + 1
    for metric in (fid, kid):
        with pytest.raises(ValueError, match=f"need at least {MIN_IMAGES} images"):
            metric(real[: MIN_IMAGES - 1], fake[: MIN_IMAGES - 1])
    row = scores(real, fake, torch.zeros(12), guidance=4.0, seed=0)
    assert row["small_n"] is True and row["kid_subset_size"] == 6 and math.isfinite(row["fid"])
    table = markdown([row])
    assert (
        "| 4 | 12\\* |" in table and "Compare these numbers only with runs of the same image count" in table
    )
    # The usual protocol's minimums: KID subsets of 1000 (N >= 2000) and N > D for FID's covariance.
    assert not small_n(2000, 64) and small_n(2000, 2048) and small_n(1999, 64)


# --- sd-convert ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def two_inputs(tmp_path_factory) -> Path:
    """An MDS image-caption set of two inputs (sd-convert folder, parts of 4 images)."""
    from data.synthetic import write_shapes_folder

    root = tmp_path_factory.mktemp("two-inputs")
    write_shapes_folder(root / "images", n=8, size=32, seed=0)
    assert (
        sd_convert(
            [
                "folder",
                "--src",
                str(root / "images"),
                "--out",
                str(root / "mds"),
                "--part-size",
                "4",
                "--no-progress",
            ]
        )
        == 0
    )
    return root / "mds"


def broken_copy(src: Path, dest: Path, inputs: list[str]) -> Path:
    """`src` with the shards of `inputs` zeroed (same size: the index still names them)."""
    import shutil

    shutil.copytree(src, dest)
    for name in inputs:
        for shard in (dest / name).glob("*.mds"):
            shard.write_bytes(b"\0" * shard.stat().st_size)
    return dest


def latents(src: Path, out: Path) -> int:
    return sd_convert(
        [
            "latents",
            "--src",
            str(src),
            "--out",
            str(out),
            "--resolutions",
            "16",
            "--preset",
            "tiny",
            "--no-progress",
        ]
    )


def test_latents_exit_non_zero_when_every_input_failed(two_inputs, tmp_path, capsys):
    names = sorted(p.name for p in two_inputs.glob("part-*"))
    assert len(names) == 2
    src = broken_copy(two_inputs, tmp_path / "src", names)
    before = snapshot(src)
    assert latents(src, tmp_path / "all-failed") == 1
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("sd-convert: error:")]
    assert len(err) == 1 and "every input failed (2 of 2; " in err[0], err
    assert f"see {tmp_path / 'all-failed'}/convert-report.json" in err[0]
    report = json.loads((tmp_path / "all-failed/convert-report.json").read_text())
    assert report["inputs_done"] == 0 and sorted(report["inputs_failed"]) == names
    assert snapshot(src) == before

    # One input of two failing is a partial result: counted, retried by the next run, exit 0.
    partial = broken_copy(two_inputs, tmp_path / "partial-src", names[:1])
    assert latents(partial, tmp_path / "partial") == 0
    report = json.loads((tmp_path / "partial/convert-report.json").read_text())
    assert report["inputs_done"] == 1 and list(report["inputs_failed"]) == names[:1]


def test_a_folder_of_nothing_usable_exits_non_zero_and_bad_json_is_counted(tmp_path, capsys):
    from tests.convert_fixtures import jpeg

    src = tmp_path / "photos"
    src.mkdir()
    for name, sidecar in (("a", "{not json"), ("b", '["a list"]'), ("c", '{"caption": null}')):
        (src / f"{name}.jpg").write_bytes(jpeg())
        (src / f"{name}.json").write_text(sidecar)
    (src / "d.jpg").write_bytes(jpeg())  # no caption file at all
    before = snapshot(src)
    assert sd_convert(["folder", "--src", str(src), "--out", str(tmp_path / "mds"), "--no-progress"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("sd-convert: error: no sample was written: every one was skipped (")
    report = json.loads((tmp_path / "mds/convert-report.json").read_text())
    # docs/data.md: a caption .json that does not parse as an object is bad_json, not missing_caption
    assert report["samples_skipped"] == {"bad_json": 2, "missing_caption": 2}
    assert snapshot(src) == before
