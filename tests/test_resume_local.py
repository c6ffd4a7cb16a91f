"""Which checkpoint a rerun resumes from when save_folder is local (recipes/resume.py), and the check of
the checkpoint a run loads against its model (recipes/load_check.py). Unit tests on small files that
look like Composer checkpoints; train.py itself does both in test_resume_cli.py."""

import logging
import os

import pytest
import torch

from recipes.load_check import load_path_problem
from recipes.resume import ResumeError, autoresume, local_autoresume


def checkpoint(path, batch: int, model: dict | None = None, preset: str | None = "tiny") -> bytes:
    """A file with what read_checkpoint reads of a Composer checkpoint; its bytes."""
    state = {"model": model or {"unet.w": torch.zeros(2)}, "timestamp": {"batch": batch}}
    state["callbacks"] = {"ModelRecord": {"preset": preset}} if preset else {}
    torch.save({"state": state}, path)
    return path.read_bytes()


@pytest.fixture
def folder(tmp_path):
    """ba1 and ba2 whole, ba3 cut short by a crash (written before atomic saves), ba4 damaged, `latest`
    pointing at ba4, a write in progress, and a sample image folder."""
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    for batch in (1, 2):
        checkpoint(ckpt / f"ep0-ba{batch}-rank0.pt", batch)
    whole = checkpoint(ckpt / "ep0-ba3-rank0.pt", 3)
    (ckpt / "ep0-ba3-rank0.pt").write_bytes(whole[: len(whole) // 2])
    (ckpt / "ep1-ba4-rank0.pt").write_bytes(b"\x80\x02 not a pickle at all")
    (ckpt / "latest-rank0.pt").symlink_to("ep1-ba4-rank0.pt")
    (ckpt / ".tmp-123-ep1-ba5-rank0.pt").write_bytes(whole[:10])
    (ckpt / "samples").mkdir()
    checkpoint(ckpt / "samples" / "ep9-ba9-rank0.pt", 9)
    return ckpt


def test_resumes_from_the_newest_checkpoint_that_loads_and_sets_the_others_aside(folder, caplog):
    before = {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file() and not p.is_symlink()}
    first_stage = {"load_path": "stage1.pt", "load_weights_only": True, "load_ignore_keys": ["x"]}
    trainer = {"save_folder": str(folder), "autoresume": True, **first_stage}
    with caplog.at_level(logging.INFO, logger="recipes.resume"):
        resumed = autoresume(trainer, "run")
    assert resumed == {
        "save_folder": str(folder),
        "autoresume": False,
        "load_path": str(folder / "ep0-ba2-rank0.pt"),
        "load_weights_only": False,
        "load_ignore_keys": None,
        "load_exclude_algorithms": None,
    }
    skipped = [r.getMessage() for r in caplog.records if "skipping" in r.getMessage()]
    assert len(skipped) == 2, skipped
    assert (
        "ep1-ba4-rank0.pt, which does not load" in skipped[0] and "ep1-ba4-rank0.pt.unreadable" in skipped[0]
    )
    assert "ep0-ba3-rank0.pt, which does not load" in skipped[1] and "truncated" in skipped[1]
    # Nothing deleted or changed: the two that do not load are under a name no resume or save takes.
    after = {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file() and not p.is_symlink()}
    renamed = {
        "ep0-ba3-rank0.pt": "ep0-ba3-rank0.pt.unreadable",
        "ep1-ba4-rank0.pt": "ep1-ba4-rank0.pt.unreadable",
    }
    assert after == {renamed.get(name, name): data for name, data in before.items()}
    assert os.readlink(folder / "latest-rank0.pt") == "ep0-ba2-rank0.pt"  # it named ba4
    # A second rerun finds the same point without touching anything again.
    assert autoresume(trainer, "run") == resumed
    assert {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file() and not p.is_symlink()} == after


def test_a_name_set_aside_before_is_not_reused(folder):
    (folder / "ep1-ba4-rank0.pt.unreadable").write_bytes(b"an earlier one")
    autoresume({"save_folder": str(folder), "autoresume": True}, "run")
    assert (folder / "ep1-ba4-rank0.pt.unreadable").read_bytes() == b"an earlier one"
    assert (folder / "ep1-ba4-rank0.pt.unreadable-2").read_bytes() == b"\x80\x02 not a pickle at all"


def test_no_checkpoint_that_loads_is_one_error_and_changes_nothing(folder):
    for batch in (1, 2):
        os.remove(folder / f"ep0-ba{batch}-rank0.pt")
    names = sorted(p.name for p in folder.iterdir())
    with pytest.raises(ResumeError, match=r"none of the 2 checkpoints in .*ckpt loads \(the newest: .*ba4"):
        local_autoresume({"save_folder": str(folder), "autoresume": True}, "run")
    assert sorted(p.name for p in folder.iterdir()) == names


@pytest.mark.parametrize(
    "trainer",
    [
        {"save_folder": "missing-{run_name}", "autoresume": True, "load_path": "stage1.pt"},
        {"save_folder": "FOLDER", "autoresume": False},
        {"save_folder": "FOLDER", "autoresume": True, "save_filename": "ep{epoch}.pt"},
    ],
)
def test_runs_without_checkpoints_or_left_to_composer(trainer, folder, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    trainer = {k: str(folder) if v == "FOLDER" else v for k, v in trainer.items()}
    resumed = local_autoresume(trainer, "run")
    if trainer["save_folder"].startswith("missing"):  # nothing saved yet: the run's own load_path
        assert resumed == {**trainer, "autoresume": False}
    else:
        assert resumed is trainer


def test_the_run_name_and_a_subfolder_in_save_filename(tmp_path):
    (tmp_path / "sd" / "ckpts").mkdir(parents=True)
    for batch in (10, 9, 100):  # 100 > 10 > 9, not as text
        checkpoint(tmp_path / "sd" / "ckpts" / f"ba{batch}.pt", batch)
    trainer = {
        "save_folder": str(tmp_path / "{run_name}"),
        "save_filename": "ckpts/ba{batch}.pt",
        "autoresume": True,
    }
    assert local_autoresume(trainer, "sd")["load_path"] == str(tmp_path / "sd" / "ckpts" / "ba100.pt")


class Tiny(torch.nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.unet = torch.nn.Linear(width, 2)


def test_another_presets_checkpoint_is_one_line_naming_both(tmp_path, caplog):
    path = tmp_path / "ckpt.pt"
    checkpoint(path, 3, model=Tiny(8).state_dict(), preset="sdxl-tiny")
    problem = load_path_problem(str(path), Tiny(4), "tiny")
    assert problem.startswith(f"trainer.load_path: {path} holds a model of preset sdxl-tiny, and this run's ")
    assert (
        "model.preset is tiny: 1 tensors differ (unet.weight: [2, 8] in the checkpoint, [2, 4] in" in problem
    )
    assert problem.endswith("set model.preset=sdxl-tiny, or give a checkpoint of a tiny model")
    assert "\n" not in problem
    # The same tensors under another preset's name (sd2-base into sd2-768-v) load, with a warning.
    with caplog.at_level(logging.WARNING, logger="recipes.load_check"):
        assert load_path_problem(str(path), Tiny(8), "tiny") is None
    assert "a sdxl-tiny checkpoint, into a tiny model" in caplog.text


def test_a_checkpoint_without_a_record_is_compared_by_its_tensors(tmp_path):
    path = tmp_path / "old.pt"
    checkpoint(path, 3, model={"unet.weight": torch.zeros(2, 4)}, preset=None)
    assert load_path_problem(str(path), Tiny(4), "tiny", strict=False) is None
    problem = load_path_problem(str(path), Tiny(4), "tiny")
    assert (
        "holds a model that records no preset" in problem
        and "unet.bias missing from the checkpoint" in problem
    )


def test_a_missing_or_torn_load_path_is_one_line(tmp_path):
    assert load_path_problem(str(tmp_path / "nope.pt"), Tiny(4), "tiny") == (
        f"trainer.load_path: checkpoint not found: {tmp_path / 'nope.pt'}"
    )
    torn = tmp_path / "torn.pt"
    torn.write_bytes(checkpoint(torn, 1)[:100])
    assert load_path_problem(str(torn), Tiny(4), "tiny").startswith(f"trainer.load_path: {torn} is truncated")
    assert load_path_problem(str(tmp_path), Tiny(4), "tiny").startswith(  # no checkpoint of any kind
        f"trainer.load_path: {tmp_path} is a folder but neither a sharded checkpoint"
    )


def test_the_last_good_state_a_nan_stop_saved_is_resumed_from(tmp_path):
    for batch in (4, 8):
        checkpoint(tmp_path / f"ep{batch // 4}-ba{batch}-rank0.pt", batch)
    checkpoint(tmp_path / "last-good-ba9-rank0.pt", 9)  # extensions.callbacks.NaNGuard: batch 10 was NaN
    trainer = {"save_folder": str(tmp_path), "autoresume": True}
    assert local_autoresume(trainer, "run")["load_path"] == str(tmp_path / "last-good-ba9-rank0.pt")
