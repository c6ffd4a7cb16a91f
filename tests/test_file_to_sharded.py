"""recipes/file_to_sharded.py: a checkpoint file written as the torch distributed checkpoint a sharded
run loads, holding the same model weights and the EMA's average where a sharded run keeps it (read
back on one process by models/checkpoints/sharded_checkpoint.py), from a local file and from one in the bucket
(SeaweedFS, downloaded into the temp space, the download removed). The 2-process continuation
itself: tests/test_fsdp2_train.py."""

from pathlib import Path

import pytest
import torch

from models.checkpoints.checkpoint_file import ema_state, model_state, read_checkpoint
from models.checkpoints.sharded_checkpoint import is_sharded_checkpoint, read_sharded_checkpoint
from recipes.file_to_sharded import sharded_copy
from tests.s3_server import BUCKET, s3_server  # noqa: F401  (s3_server is a fixture)


def _same_weights(folder: Path, file: Path) -> None:
    assert is_sharded_checkpoint(folder)
    state, want = read_sharded_checkpoint(folder), read_checkpoint(file)
    ours, theirs = model_state(state), model_state(want)
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in theirs)
    average, expected = ema_state(state), ema_state(want)
    assert expected and average.keys() == expected.keys()
    assert all(torch.equal(average[k], expected[k]) for k in expected)


def test_a_local_file_is_written_sharded_with_its_weights_and_ema(tiny_checkpoint):
    folder = Path(sharded_copy(str(tiny_checkpoint)))
    _same_weights(folder, tiny_checkpoint)
    assert folder.parent.name.startswith("sd-resume-") and sorted(
        p.name for p in folder.parent.iterdir()
    ) == ["checkpoint"]


@pytest.mark.server
def test_a_file_in_the_bucket_is_downloaded_then_written_sharded(s3_server, tiny_checkpoint, monkeypatch):  # noqa: F811
    for name, value in s3_server.env().items():
        monkeypatch.setenv(name, value)
    s3_server.client().upload_file(str(tiny_checkpoint), BUCKET, "runs/one/ep0-ba3-rank0.pt")
    folder = Path(sharded_copy(f"s3://{BUCKET}/runs/one/ep0-ba3-rank0.pt"))
    _same_weights(folder, tiny_checkpoint)
    assert sorted(p.name for p in folder.parent.iterdir()) == ["checkpoint"]  # the download is gone
