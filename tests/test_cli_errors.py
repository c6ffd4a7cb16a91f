"""The CLIs' mistakes as a user meets them: one line, a non-zero exit, nothing slow before the cheap
checks, -v that adds this repo's DEBUG lines only, and each program named as it is run."""

import logging
import shutil
import zipfile

import pytest

from convert import __main__ as sd_convert
from demo import judge as demo_judge
from evaluation import evaluate, extractors
from models import export, flops, generate

# module -> its argv around a checkpoint path, the rest of each command valid.
COMMANDS = {
    "models.export": lambda ckpt, tmp, data: [str(ckpt), str(tmp / "exported")],
    "models.generate": lambda ckpt, tmp, data: [str(ckpt), "a red circle", "--out", str(tmp / "g.png")],
    "evaluation.evaluate": lambda ckpt, tmp, data: [
        *[str(ckpt), "--data", str(data), "--out", str(tmp / "eval"), "--extractors", "tiny"]
    ],
    "demo.judge": lambda ckpt, tmp, data: [str(ckpt), "--out", str(tmp / "demo")],
}
# setup.py's packages: what -v is for
OURS = ("common", "convert", "data", "demo", "evaluation", "extensions", "models", "recipes")
MAINS = {
    "models.export": export.main,
    "models.generate": generate.main,
    "evaluation.evaluate": evaluate.main,
    "demo.judge": demo_judge.main,
}


@pytest.fixture(scope="module")
def bad_checkpoints(tiny_checkpoint, tmp_path_factory) -> dict:
    """What a user passes by mistake: a checkpoint cut short by an interrupted copy, and a text file."""
    folder = tmp_path_factory.mktemp("bad-checkpoints")
    whole = tiny_checkpoint.read_bytes()
    (folder / "truncated.pt").write_bytes(whole[: len(whole) // 2])
    (folder / "notes.pt").write_text("loss went down, then up\n" * 20)
    return {"truncated": folder / "truncated.pt", "text": folder / "notes.pt"}


def one_line_exit(main, argv) -> str:
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    message = exit_.value.code
    assert isinstance(message, str), f"exit status {message!r}, not an error message"
    assert "\n" not in message
    return message


@pytest.mark.parametrize("module", sorted(COMMANDS))
@pytest.mark.parametrize(
    "kind, says",
    [("truncated", "is truncated"), ("text", "is not a Composer checkpoint")],
)
def test_a_truncated_or_foreign_checkpoint_is_one_line(
    module, kind, says, bad_checkpoints, shapes_mds, tmp_path, capsys
):
    bad = bad_checkpoints[kind]
    message = one_line_exit(MAINS[module], COMMANDS[module](bad, tmp_path, shapes_mds / "mds"))
    assert message.startswith(f"python -m {module}: error: {bad} {says}"), message
    assert "Traceback" not in capsys.readouterr().err
    assert not (tmp_path / "exported").exists() and not (tmp_path / "g.png").exists()


@pytest.fixture(scope="module")
def odd_files(tmp_path_factory) -> dict:
    """Files that pass for a checkpoint at a glance, by what the message says about each."""
    import torch

    folder = tmp_path_factory.mktemp("odd-files")
    (folder / "empty.pt").write_bytes(b"")
    # torch.save's pickle format before torch 1.6: nothing marks where it ends, so a cut one reads
    # as "not a checkpoint, or truncated".
    torch.save(
        {"state": {"model": {"w": torch.ones(64, 64)}}},
        folder / "old.pt",
        _use_new_zipfile_serialization=False,
    )
    whole = (folder / "old.pt").read_bytes()
    (folder / "old-cut.pt").write_bytes(whole[: len(whole) // 2])
    with zipfile.ZipFile(folder / "images.zip", "w") as archive:
        archive.writestr("a.txt", "not a tensor")
    torch.save({"weights": torch.ones(2)}, folder / "weights.pt")
    return {
        "is truncated (0 bytes, empty": folder / "empty.pt",
        "is not a Composer checkpoint, or is truncated (torch.load: unexpected EOF": folder / "old-cut.pt",
        "is not a Composer checkpoint (torch.load: ": folder / "images.zip",
        "is not a Composer checkpoint (no state['model'] in it)": folder / "weights.pt",
    }


def test_odd_files_are_one_line_too(odd_files, tmp_path, capsys):
    for says, path in odd_files.items():
        message = one_line_exit(export.main, [str(path), str(tmp_path / "out")])
        assert message.startswith(f"python -m models.export: error: {path} {says}"), message
    assert "Traceback" not in capsys.readouterr().err


@pytest.fixture
def nothing_loads(monkeypatch):
    """The slow steps of evaluation.evaluate fail the test if they are reached."""

    def slow(what):
        def fail(*args, **kwargs):
            pytest.fail(f"{what} loaded before the cheap arguments were checked")

        return fail

    monkeypatch.setattr(evaluate, "load_model", slow("the checkpoint"))
    monkeypatch.setattr(extractors, "inception", slow("the Inception network"))
    monkeypatch.setattr(extractors, "clip", slow("the CLIP model"))
    monkeypatch.setattr(evaluate, "open_dataset", slow("the data set"))


def test_evaluate_checks_the_cheap_arguments_before_loading_anything(
    nothing_loads, tiny_checkpoint, shapes_mds, tmp_path
):
    ckpt, data, out = str(tiny_checkpoint), str(shapes_mds / "mds"), tmp_path / "out"
    tiny = ["--extractors", "tiny"]

    missing = tmp_path / "no-such-set"
    message = one_line_exit(evaluate.main, [ckpt, "--data", str(missing), "--out", str(out), *tiny])
    assert f"--data {missing}: no MDS index.json there" in message

    inception = tmp_path / "inception.pth"
    inception.write_bytes(b"weights")  # present: only the CLIP weights are missing
    message = one_line_exit(
        evaluate.main,
        [ckpt, "--data", data, "--out", str(out), "--inception-weights", str(inception)],
    )
    assert "CLIP score needs ViT-H-14 weights (no --clip-model given)" in message

    pipeline = tmp_path / "pipeline"
    pipeline.mkdir()
    (pipeline / "model_index.json").write_text("{}")
    message = one_line_exit(evaluate.main, [str(pipeline), "--data", data, "--out", str(out), "--ema", *tiny])
    assert "--ema/--raw choose weights inside a checkpoint" in message

    a_file = tmp_path / "metrics.txt"
    a_file.write_text("")
    message = one_line_exit(evaluate.main, [ckpt, "--data", data, "--out", str(a_file), *tiny])
    assert f"--out {a_file} is a file" in message

    message = one_line_exit(
        evaluate.main, [ckpt, "--data", data, "--out", str(out), "--resolution", "0", *tiny]
    )
    assert message.endswith("--resolution 0: must be at least 1")


@pytest.fixture
def unconfigured_logging():
    """Call it to take the handlers off the root logger, as a fresh `python -m ...` process has it:
    logging.basicConfig does nothing where the root has one, and pytest adds its capture handlers
    when the test body starts, after the fixtures (and removes them itself after). basicConfig's
    handler and the loggers' levels are undone after the test."""
    root = logging.getLogger()
    before = root.handlers[:]
    levels = {name: logging.getLogger(name).level for name in ["", *OURS, "PIL"]}
    yield root.handlers.clear
    for handler in root.handlers[:]:
        if type(handler) is logging.StreamHandler and handler not in before:  # basicConfig's
            root.removeHandler(handler)
            handler.close()
    for name, level in levels.items():
        logging.getLogger(name).setLevel(level)  # setLevel, not an assignment: it clears logging's caches


def test_verbose_is_debug_for_this_repo_only(unconfigured_logging, shapes_mds, tmp_path, capsys):
    src = tmp_path / "src"
    src.mkdir()
    for image in sorted((shapes_mds / "images").glob("*.png"))[:3]:
        shutil.copy(image, src)
        shutil.copy(image.with_suffix(".txt"), src)
    (src / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n cut short")  # skipped: a DEBUG line of ours
    (src / "broken.txt").write_text("a broken image")

    unconfigured_logging()
    assert sd_convert.main(["folder", "--src", str(src), "--out", str(tmp_path / "mds"), "-v"]) == 0

    err = capsys.readouterr().err
    assert "DEBUG convert.pipeline: " in err and "skipped broken" in err
    debug_loggers = {line.split()[1].rstrip(":") for line in err.splitlines() if line.startswith("DEBUG ")}
    assert {name.split(".")[0] for name in debug_loggers} <= set(OURS), debug_loggers
    # PIL's PNG plugin logs every chunk it reads at DEBUG: left on, they drown the output.
    assert logging.getLogger().level == logging.INFO
    assert not logging.getLogger("PIL.PngImagePlugin").isEnabledFor(logging.DEBUG)
    assert logging.getLogger("evaluation.evaluate").isEnabledFor(logging.DEBUG)


def test_without_verbose_there_is_no_debug(unconfigured_logging, shapes_mds, tmp_path, capsys):
    src = tmp_path / "src"
    src.mkdir()
    image = sorted((shapes_mds / "images").glob("*.png"))[0]
    shutil.copy(image, src)
    shutil.copy(image.with_suffix(".txt"), src)
    unconfigured_logging()
    assert sd_convert.main(["folder", "--src", str(src), "--out", str(tmp_path / "mds")]) == 0
    assert "DEBUG" not in capsys.readouterr().err
    assert not logging.getLogger("convert.pipeline").isEnabledFor(logging.DEBUG)


@pytest.mark.parametrize(
    "main, prog",
    [
        (generate.parse_args, "python -m models.generate"),
        (export.parse_args, "python -m models.export"),
        (flops.main, "python -m models.flops"),
        (evaluate.parse_args, "python -m evaluation.evaluate"),
        (sd_convert.main, "sd-convert"),
    ],
)
def test_help_names_the_program_as_it_is_run(main, prog, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--help"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.startswith(f"usage: {prog} ")
