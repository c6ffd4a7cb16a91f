"""A user's mistakes after training, on the real entry points (issue 37): each is one line and a
non-zero exit before anything slow runs, and nothing of the user's is changed or merged into.
models.export into a folder that is not empty, the VAE recipe's export over a folder not its own,
generate's sizes and numbers, evaluate's image counts, and sd-convert's runs that made nothing."""

import json
import math
from pathlib import Path

import pytest
import torch

from convert.__main__ import main as sd_convert
from evaluation import evaluate, extractors
from evaluation.image_metrics import MIN_IMAGES, fid, kid, markdown, scores, small_n
from models import build_model, export, generate
from recipes import ConfigError, load_config, parse_config
from tests.conftest import REPO


def snapshot(root: Path) -> dict[str, tuple[bytes, int]]:
    """Every file under `root` (and root itself when a file): its bytes and mtime."""
    files = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file())
    return {str(p): (p.read_bytes(), p.stat().st_mtime_ns) for p in files}


def siblings(folder: Path) -> list[str]:
    """What lies beside `folder` other than the test's own files: a temporary write left behind."""
    return sorted(p.name for p in folder.parent.iterdir() if p.name.startswith("."))


def one_line_exit(main, argv) -> str:
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    message = exit_.value.code
    assert isinstance(message, str), f"exit status {message!r}, not an error message"
    assert "\n" not in message and "Traceback" not in message
    return message


@pytest.fixture
def nothing_loads(monkeypatch):
    """Loading a model or an extractor fails the test: the mistake had to be found before."""

    def refuse(what):
        def fail(*args, **kwargs):
            pytest.fail(f"{what} was loaded before the mistake was found")

        return fail

    for module in (generate, evaluate):
        monkeypatch.setattr(module, "load_model", refuse("the model"))
    monkeypatch.setattr(export, "load_model_from_checkpoint", refuse("the checkpoint"))
    monkeypatch.setattr(extractors, "inception", refuse("the Inception network"))
    monkeypatch.setattr(extractors, "clip", refuse("the CLIP model"))


# --- models.export ---------------------------------------------------------------------------------


def another_pipeline(folder: Path) -> None:
    """What a user may already have at OUT_DIR: an SDXL pipeline, whose text_encoder_2/ would make a
    merged SD export load as SDXL."""
    (folder / "text_encoder_2").mkdir(parents=True)
    (folder / "text_encoder_2/config.json").write_text('{"architectures": ["CLIPTextModelWithProjection"]}')
    (folder / "model_index.json").write_text('{"_class_name": "StableDiffusionXLPipeline"}')


@pytest.mark.parametrize("kind", ["pipeline", "one file", "a file", "a link"])
def test_export_refuses_what_is_there_before_reading_the_checkpoint(kind, tmp_path, nothing_loads):
    out = tmp_path / "out"
    if kind == "pipeline":
        another_pipeline(out)
    elif kind == "one file":
        out.mkdir()
        (out / "notes.txt").write_text("mine")
    elif kind == "a file":
        out.write_text("mine")
    else:
        (tmp_path / "elsewhere").mkdir()
        out.symlink_to(tmp_path / "elsewhere")
    before = snapshot(tmp_path)
    checkpoint = tmp_path / "ckpt.pt"  # never read: the folder is checked first
    message = one_line_exit(export.main, [str(checkpoint), str(out)])
    assert message.startswith(f"python -m models.export: error: {out} ")
    assert "new or empty folder" in message
    assert snapshot(tmp_path) == before and siblings(out) == []


def test_export_into_an_empty_folder_and_a_failed_one_leaves_nothing(tiny_checkpoint, tmp_path, monkeypatch):
    out = tmp_path / "empty"
    out.mkdir()
    export.main([str(tiny_checkpoint), str(out)])  # an empty folder is fine
    assert (out / "model_index.json").is_file() and not (out / "text_encoder_2").exists()
    assert generate.load_model(out).__class__.__name__ == "StableDiffusion"
    assert siblings(out) == []

    # A failure halfway through the save (disk full, a kill) leaves no OUT_DIR that looks finished.
    from diffusers import StableDiffusionPipeline

    def half_a_save(self, folder, **kwargs):
        Path(folder, "unet").mkdir(parents=True)
        Path(folder, "unet/config.json").write_text("{}")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(StableDiffusionPipeline, "save_pretrained", half_a_save)
    message = one_line_exit(export.main, [str(tiny_checkpoint), str(tmp_path / "new")])
    assert message.endswith(
        f"writing {tmp_path / 'new'}: [Errno 28] No space left on device; nothing was written there"
    )
    assert not (tmp_path / "new").exists() and siblings(out) == []


# --- extensions.save_pretrained (yamls/tiny-vae.yaml's export) ---------------------------------------


def vae_config(folder: Path):
    return parse_config(
        load_config(REPO / "yamls/tiny-vae.yaml", [f"callbacks.save_pretrained.folder={folder}"])
    )


def test_the_vae_recipe_refuses_a_folder_it_did_not_write_at_parse_time(tmp_path):
    another_pipeline(tmp_path / "export")
    before = snapshot(tmp_path)
    with pytest.raises(ConfigError) as error:
        vae_config(tmp_path / "export")
    message = str(error.value)
    assert message.startswith(f"callbacks.save_pretrained.folder={tmp_path / 'export'} holds files that no")
    assert "\n" not in message and snapshot(tmp_path) == before
    vae_config(tmp_path / "new")  # absent: fine, and nothing is made at parse time
    assert not (tmp_path / "new").exists()


def test_a_rerun_replaces_its_own_export_and_no_other(tmp_path):
    from types import SimpleNamespace

    from extensions.save_pretrained import MARK, SavePretrained
    from models.autoencoder import build_autoencoder

    folder = tmp_path / "export"
    state = SimpleNamespace(model=build_autoencoder("tiny"), run_name="tiny-vae")
    SavePretrained(str(folder)).fit_end(state, logger=None)
    assert json.loads((folder / MARK).read_text())["run_name"] == "tiny-vae"
    first = (folder / "vae/config.json").stat().st_mtime_ns

    again = SavePretrained(str(folder))  # the same recipe rerun: its own export, replaced
    again.fit_start(state, logger=None)
    again.fit_end(state, logger=None)
    assert (folder / "vae/config.json").stat().st_mtime_ns != first and siblings(folder) == []

    before = snapshot(folder)
    other = SimpleNamespace(model=state.model, run_name="another-run")
    with pytest.raises(
        ValueError, match=r"^folder=.* holds the export of run 'tiny-vae', not of this run \('another-run'\)"
    ):
        SavePretrained(str(folder)).fit_start(other, logger=None)  # before any training
    assert snapshot(folder) == before


# --- models.generate ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "flags, says",
    [
        (["--guidance", "-1"], "--guidance -1: guidance scales must be finite and >= 0"),
        (["--guidance", "nan"], "--guidance nan: guidance scales must be finite"),
        (["--steps", "0"], "--steps 0: must be at least 1"),
        (["--n-per-prompt", "0"], "--n-per-prompt 0: must be at least 1"),
        (["--height", "0"], "--height 0: must be at least 1"),
        (["--width", "-32"], "--width -32: must be at least 1"),
        (["--guidance-rescale", "1.5"], "--guidance-rescale 1.5: must be between 0 and 1"),
        (["--out", "grid.jpg"], "--out grid.jpg: give a .png file"),
    ],
)
def test_generate_numbers_out_of_range_before_the_model_loads(flags, says, tmp_path, nothing_loads):
    argv = [str(tmp_path / "ckpt.pt"), "a red circle", "--out", str(tmp_path / "g.png"), *flags]
    message = one_line_exit(generate.main, argv)
    assert message == f"python -m models.generate: error: {says}" or says in message, message
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "flag, value, says",
    [
        (
            "--height",
            "30",
            "--height 30: must be a multiple of 4 (the VAE's factor 4); the nearest valid sizes: 28 or 32",
        ),
        (
            "--width",
            "2",
            "--width 2: must be a multiple of 4 (the VAE's factor 4); the nearest valid sizes: 4",
        ),
    ],
)
def test_generate_sizes_the_vae_would_round(flag, value, says, tiny_pipeline, tmp_path, monkeypatch):
    folder, _ = tiny_pipeline
    monkeypatch.setattr(generate, "sample_grid", lambda *a, **k: pytest.fail("sampled before the check"))
    argv = [str(folder), "a red circle", "--out", str(tmp_path / "g.png"), flag, value]
    assert one_line_exit(generate.main, argv) == f"python -m models.generate: error: {says}"
    assert not (tmp_path / "g.png").exists()


def test_mmdit_sizes_are_multiples_of_the_patch_too():
    from models.cli_checks import UsageError, check_sampling_args, check_size

    model = build_model("mmdit-tiny")  # a VAE factor of 4, patches of 2
    check_size("--height", 40, model)
    with pytest.raises(
        UsageError, match=r"^--height 36: must be a multiple of 8 \(the VAE's factor 4 x the "
    ):
        check_size("--height", 36, model)
    with pytest.raises(UsageError, match="^resolution=20: .* nearest valid sizes: 16 or 24$"):
        check_size("resolution", 20, model)
    with pytest.raises(UsageError, match="^--guidance-rescale 0.7: an mmdit model's flow sampling has no"):
        check_sampling_args(model, {}, ("--guidance-rescale", 0.7))


@pytest.mark.parametrize("guidance", ["-1", "[1.0,-0.5]", "nan", "high"])
def test_sample_grids_guidance_is_checked_when_the_config_is_parsed(guidance):
    config = load_config(REPO / "yamls/tiny-cpu.yaml", [f"callbacks.samples.guidance={guidance}"])
    with pytest.raises(ConfigError, match=r"^callbacks\.samples\.guidance=") as error:
        parse_config(config)
    assert "\n" not in str(error.value)


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
def test_evaluate_numbers_before_anything_loads(
    flags, says, shapes_mds, tmp_path, nothing_loads, monkeypatch
):
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


def test_evaluate_a_set_too_small_before_any_sampling(six_rows, tiny_pipeline, tmp_path, nothing_loads):
    folder, _ = tiny_pipeline
    message = one_line_exit(
        evaluate.main, eval_args(folder, six_rows, tmp_path / "out", "--num-captions", "24")
    )
    assert message.startswith(
        f"python -m evaluation.evaluate: error: --data {six_rows} has 6 rows: FID and KID"
    )
    assert not (tmp_path / "out" / "images").exists()


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
