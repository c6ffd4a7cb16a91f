"""train.py onto checkpoints it cannot use as they are: a rerun whose newest checkpoint is torn resumes
from the newest complete one and says so, and a load_path of another preset's checkpoint is one
`config error:` line before anything trains (recipes/resume.py, recipes/load_check.py)."""

import logging
import shutil

import pytest
import torch

import train as train_py
from tests.conftest import REPO, tiny_run


def overrides(shapes_mds, batches: int, **trainer) -> list[str]:
    """tests.conftest.tiny_checkpoint's run for `batches` batches, with `trainer` keys set instead."""
    keys = {f"trainer.{key}" for key in trainer}
    run = [o for o in tiny_run(shapes_mds, batches) if o.split("=")[0] not in keys]
    return [*run, "algorithms.ema.half_life=2", *(f"trainer.{k}={v}" for k, v in trainer.items())]


def test_a_rerun_onto_a_torn_newest_checkpoint_resumes_from_the_one_before(
    tiny_checkpoint, shapes_mds, tmp_path, caplog
):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    shutil.copy(tiny_checkpoint, ckpt / "ep0-ba3-rank0.pt")  # 3 batches
    whole = tiny_checkpoint.read_bytes()
    torn = whole[: len(whole) // 2]  # batch 4's, cut short by a crash before saves were atomic
    (ckpt / "ep0-ba4-rank0.pt").write_bytes(torn)
    args = overrides(shapes_mds, 4, save_folder=ckpt, autoresume="true", save_overwrite="false")
    with caplog.at_level(logging.INFO):
        train_py.main([str(REPO / "yamls/tiny-cpu.yaml"), *args])
    said = [r.getMessage() for r in caplog.records if r.name == "recipes.resume"]
    assert said[0].startswith(f"autoresume: skipping {ckpt / 'ep0-ba4-rank0.pt'}, which does not load (")
    assert "is truncated" in said[0] and "renamed to ep0-ba4-rank0.pt.unreadable, not deleted" in said[0]
    assert said[1].startswith(f"autoresume: resuming from {ckpt / 'ep0-ba3-rank0.pt'}")
    assert (ckpt / "ep0-ba4-rank0.pt.unreadable").read_bytes() == torn  # kept, byte for byte
    assert (ckpt / "ep0-ba3-rank0.pt").read_bytes() == whole
    # It trained batch 4 only, and saved it under the name the torn file had (save_overwrite=false:
    # left there, Composer would have refused to start, and a save over it would have lost it).
    state = torch.load(ckpt / "ep0-ba4-rank0.pt", weights_only=False)["state"]
    assert state["timestamp"]["Timestamp"]["batch"] == 4


def test_load_path_of_another_presets_checkpoint_is_one_config_error(tiny_checkpoint, shapes_mds, tmp_path):
    args = overrides(shapes_mds, 4, load_path=tiny_checkpoint, save_folder=tmp_path / "ckpt")
    with pytest.raises(SystemExit) as exit_:
        train_py.main([str(REPO / "yamls/tiny-sdxl-cpu.yaml"), *args])
    message = str(exit_.value.code)
    assert message.startswith(
        f"config error: trainer.load_path: {tiny_checkpoint} holds a model of preset tiny, and this run's "
        "model.preset is sdxl-tiny: "
    ), message
    assert message.endswith("set model.preset=tiny, or give a checkpoint of a sdxl-tiny model")
    assert "\n" not in message
    assert not (tmp_path / "ckpt").exists()  # nothing trained or saved


def test_autoresume_s_own_choice_is_named_as_such_not_as_the_user_s_load_path(
    tiny_checkpoint, shapes_mds, tmp_path
):
    """The user set no trainer.load_path: the line names the checkpoint autoresume chose (issue 47)."""
    (tmp_path / "ckpt").mkdir()
    shutil.copy(tiny_checkpoint, tmp_path / "ckpt" / "ep0-ba3-rank0.pt")
    args = overrides(shapes_mds, 4, save_folder=tmp_path / "ckpt", autoresume="true")
    with pytest.raises(SystemExit) as exit_:
        train_py.main([str(REPO / "yamls/tiny-sdxl-cpu.yaml"), *args])
    message = str(exit_.value.code)
    assert message.startswith(
        f"config error: autoresume's checkpoint: {tmp_path / 'ckpt' / 'ep0-ba3-rank0.pt'} holds a model of "
        "preset tiny, and this run's model.preset is sdxl-tiny: "
    ), message
    assert "trainer.load_path" not in message and "\n" not in message


def test_a_rerun_of_a_finished_run_trains_nothing_and_keeps_its_ema(
    tiny_checkpoint, shapes_mds, tmp_path, caplog
):
    """tiny_checkpoint is a finished 3-batch run: rerun with its max_duration, the recipe loads it,
    says it is complete, saves nothing, and the returned trainer holds its weights and EMA average."""
    from extensions.ema import find_ema
    from recipes import load_config, train

    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    shutil.copy(tiny_checkpoint, ckpt / "ep0-ba3-rank0.pt")
    saved = torch.load(tiny_checkpoint, weights_only=False)["state"]
    args = overrides(shapes_mds, 3, save_folder=ckpt, autoresume="true")
    with caplog.at_level(logging.WARNING):
        trainer = train(load_config(REPO / "yamls/tiny-cpu.yaml", args))
    assert any("run tiny-cpu is complete" in r.getMessage() for r in caplog.records)
    assert sorted(p.name for p in ckpt.iterdir()) == ["ep0-ba3-rank0.pt"]  # nothing new written
    assert int(trainer.state.timestamp.batch) == 3
    average = find_ema(trainer.state.algorithms).averaged_state()
    (ema_state,) = [v for k, v in saved["algorithms"] if k == "EMA"]
    assert average and all(torch.equal(average[name], ema_state["ema"][name]) for name in average)


@pytest.mark.fit
def test_the_keep_count_holds_over_the_whole_run_not_per_start(shapes_mds, tmp_path):
    """save_num_checkpoints_to_keep=2 over a run restarted once: 2 checkpoints at the end, not the 2 of
    each start (Composer rotates only what it saved since it started: recipes/keep_checkpoints.py)."""
    import re

    ckpt = tmp_path / "ckpt"
    common = dict(save_folder=ckpt, save_interval="1ba", save_num_checkpoints_to_keep=2, autoresume="true")

    def batches() -> list[int]:
        names = [p.name for p in ckpt.iterdir() if not p.is_symlink()]
        return sorted(int(re.match(r"ep\d+-ba(\d+)-rank0\.pt$", n)[1]) for n in names)

    train_py.main([str(REPO / "yamls/tiny-cpu.yaml"), *overrides(shapes_mds, 3, **common)])
    assert batches() == [2, 3]
    train_py.main([str(REPO / "yamls/tiny-cpu.yaml"), *overrides(shapes_mds, 5, **common)])
    assert batches() == [4, 5]
