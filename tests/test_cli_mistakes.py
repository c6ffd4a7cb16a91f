"""A user's mistakes after training, on the real entry points (issue 37): each is one line and a
non-zero exit before anything slow runs, and nothing of the user's is changed or merged into.
models.export into a folder that is not empty, the VAE recipe's export over a folder not its own,
generate's sizes and numbers, the sample grids' guidance. (evaluate and sd-convert:
tests/test_cli_mistakes_data.py, which shares the helpers here.)"""

import json
from pathlib import Path

import pytest

from evaluation import evaluate, extractors
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
