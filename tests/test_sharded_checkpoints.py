"""Sharded checkpoints (torch distributed checkpoint folders, models/checkpoints/sharded_checkpoint.py): when
one is complete, which one a rerun resumes from, local (recipes/resume.py) and remote
(recipes/remote_sharded.py), and reading one on a single process. The folders are real ones, written by
torch's `dcp.save` on one process, in the layout Composer gives them."""

import logging
import shutil
import warnings
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint import save as dcp_save

from models.checkpoints.sharded_checkpoint import (
    ShardedCheckpointError,
    check_complete,
    read_metadata,
    read_sharded_checkpoint,
    tensor_shapes,
)
from recipes.remote_sharded import complete_remote_checkpoints
from recipes.resume import loads_sharded, local_autoresume, sharded_pattern


def sharded(folder: Path, batch: int, start_batch: int | None = 1) -> Path:
    """A checkpoint as Composer writes it under FSDP2, in a folder of its own: model, optimizer, an EMA
    whose average travels in the EMAShards callback's state (extensions/ema_sharded.py), the record."""
    weight = torch.arange(12.0).reshape(3, 4) + batch
    state = {
        "state": {
            "model": {"transformer.w": weight, "latent_scale": torch.tensor(0.5)},
            "optimizers": {"AdamW": {"state": {"transformer.w": {"exp_avg": torch.ones(3, 4)}}}},
            "algorithms": [("EMA", {"start_batch": start_batch, "ema": "sharded: in callbacks.EMAShards"})],
            "callbacks": {
                "EMAShards": {"ema": {"transformer.w": weight / 2}},
                "ModelRecord": {"preset": "x"},
            },
            "timestamp": {"batch": batch},
        },
        "rng": [{"torch": torch.zeros(3, dtype=torch.uint8)}],
    }
    with warnings.catch_warnings():  # one process: "torch.distributed is disabled"
        warnings.simplefilter("ignore", UserWarning)
        dcp_save(state, checkpoint_id=str(folder), no_dist=True)
    return folder


@pytest.fixture
def ckpt(tmp_path) -> Path:
    """ba1, ba2 complete; ba3 without its .metadata (killed while ranks wrote); ep1-ba4 with its
    shard file cut short; `latest` pointing at ep1-ba4."""
    folder = tmp_path / "ckpt"
    for batch in (1, 2, 3):
        sharded(folder / f"ep0-ba{batch}", batch)
    (folder / "ep0-ba3" / ".metadata").unlink()
    cut = sharded(folder / "ep1-ba4", 4) / "__0_0.distcp"
    cut.write_bytes(cut.read_bytes()[:100])
    (folder / "latest-rank0.pt").symlink_to("ep1-ba4")
    return folder


def test_completeness(ckpt):
    assert tensor_shapes(check_complete(ckpt / "ep0-ba2")) == {"transformer.w": (3, 4), "latent_scale": ()}
    with pytest.raises(
        ShardedCheckpointError, match=r"ep0-ba3 is an incomplete sharded checkpoint: no \.metadata"
    ):
        check_complete(ckpt / "ep0-ba3")
    with pytest.raises(
        ShardedCheckpointError, match=r"__0_0.distcp is cut short \(100 of at least \d+ bytes\)"
    ):
        check_complete(ckpt / "ep1-ba4")
    shutil.copytree(ckpt / "ep0-ba2", ckpt / "lost")
    (ckpt / "lost" / "__0_0.distcp").unlink()
    with pytest.raises(ShardedCheckpointError, match="__0_0.distcp is missing"):
        check_complete(ckpt / "lost")


def test_autoresume_takes_the_newest_complete_one_and_sets_the_others_aside(ckpt, caplog):
    with caplog.at_level(logging.WARNING, logger="recipes.resume"):
        resumed = local_autoresume({"save_folder": str(ckpt), "autoresume": True}, "run")
    assert resumed["load_path"] == str(ckpt / "ep0-ba2") and resumed["autoresume"] is False
    assert loads_sharded(resumed["load_path"])
    names = sorted(p.name for p in ckpt.iterdir())
    assert names == ["ep0-ba1", "ep0-ba2", "ep0-ba3.incomplete", "ep1-ba4.unreadable", "latest-rank0.pt"]
    assert (ckpt / "latest-rank0.pt").resolve() == ckpt / "ep0-ba2"  # no longer at what was set aside
    skipped = " ".join(r.getMessage() for r in caplog.records)
    assert "ep1-ba4, which does not load" in skipped and "cut short" in skipped
    assert "ep0-ba3 is a sharded checkpoint whose save never finished" in skipped


def test_a_first_save_cut_short_starts_the_run_afresh(tmp_path):
    """A kill during the first checkpoint's save: no checkpoint yet (as a `.tmp-` file is none), so the
    run starts from its beginning, the unfinished folder renamed out of the way of its new save."""
    folder = tmp_path / "ckpt"
    (sharded(folder / "ep0-ba1", 1) / ".metadata").unlink()
    trainer = {"save_folder": str(folder), "autoresume": True}
    assert local_autoresume(trainer, "run") == {**trainer, "autoresume": False}
    assert sorted(p.name for p in folder.iterdir()) == ["ep0-ba1.incomplete"]


def test_a_newer_checkpoint_file_beside_sharded_folders_wins(ckpt):
    """A run that changed from sharding to data parallelism resumes its newest checkpoint of either kind."""
    torch.save({"state": {"model": {}, "timestamp": {}}}, ckpt / "ep2-ba9-rank0.pt")
    resumed = local_autoresume({"save_folder": str(ckpt), "autoresume": True}, "run")
    assert resumed["load_path"] == str(ckpt / "ep2-ba9-rank0.pt") and not loads_sharded(resumed["load_path"])


@pytest.mark.parametrize(
    ("path", "sharded"),
    [("s3://b/run/ep0-ba4", True), ("s3://b/run/ep0-ba4-rank0.pt", False), (None, False), ("", False)],
)
def test_loads_sharded_remote_paths(path, sharded):
    assert loads_sharded(path) is sharded


class FolderStore:
    """The object store calls recipes/remote_sharded.py makes, over a local folder."""

    def __init__(self, root: Path):
        self.root = root

    def list_objects(self, prefix: str) -> list[str]:
        return sorted(str(p.relative_to(self.root)) for p in self.root.rglob("*") if p.is_file())

    def download_object(self, name: str, filename: str) -> None:
        shutil.copy(self.root / name, filename)

    def get_object_size(self, name: str) -> int:
        if not (self.root / name).is_file():
            raise FileNotFoundError(name)
        return (self.root / name).stat().st_size

    def get_uri(self, name: str) -> str:
        return f"s3://bucket/{name}"


def test_remote_completeness(tmp_path, caplog):
    """An upload cut short by a kill: the newest folder's second rank's file never arrived."""
    root = tmp_path / "bucket"
    for batch in (1, 2):
        sharded(root / "run" / f"ep0-ba{batch}", batch)
    (root / "run" / "ep0-ba2" / "__0_0.distcp").unlink()
    sharded(root / "run" / "ep0-ba3", 3)
    (root / "run" / "ep0-ba3" / ".metadata").unlink()  # not uploaded yet: not a candidate at all
    store = FolderStore(root)
    pattern = sharded_pattern("ep{epoch}-ba{batch}-rank{rank}.pt", "run")
    with caplog.at_level(logging.WARNING, logger="recipes.remote_sharded"):
        found = complete_remote_checkpoints(store, store.list_objects("run/"), "run/", pattern)
    assert found == {1: "run/ep0-ba1"}
    assert (
        "skipping s3://bucket/run/ep0-ba2, an incomplete sharded checkpoint (__0_0.distcp is missing)"
        in caplog.text
    )


def test_read_on_one_process(tmp_path):
    """The state export reads, as from a checkpoint file: the model, the EMA's average back in the
    EMA's state (None before it started), the callbacks; no optimizer state."""
    state = read_sharded_checkpoint(sharded(tmp_path / "ep0-ba5", 5))
    assert state.keys() == {"model", "algorithms", "callbacks"}
    assert torch.equal(state["model"]["transformer.w"], torch.arange(12.0).reshape(3, 4) + 5)
    [(name, ema)] = state["algorithms"]
    assert name == "EMA" and torch.equal(ema["ema"]["transformer.w"], state["model"]["transformer.w"] / 2)
    assert state["callbacks"]["ModelRecord"] == {"preset": "x"}
    before_start = read_sharded_checkpoint(sharded(tmp_path / "ep0-ba6", 6, start_batch=None))
    assert before_start["algorithms"][0][1]["ema"] is None
    assert read_metadata(tmp_path / "ep0-ba6").storage_data  # a metadata that names its files
