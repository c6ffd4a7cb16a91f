"""Sharded training (FSDP2, recipes/parallelism.py) on the tiny MMDiT over gloo, end to end:
`composer -n 2 ... parallelism.shard=2` trains like the one-process run and writes sharded checkpoints
(the EMA's average sharded with the model); SIGKILLed at a random moment and rerun, it ends bitwise
equal to the uninterrupted run; its checkpoint continues on one process (elastic); HSDP on 4
processes trains and resumes the same way. The uninterrupted runs are shared session fixtures
(tests/conftest.py mmdit_reference)."""

import shutil

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader

from extensions.callbacks import read_loss_log
from tests.conftest import REPO
from tests.fsdp2_runs import BATCHES, COMMON, RECIPE, mmdit_command
from tests.probes import read_key_log
from tests.resume_check import (
    assert_same_run,
    kill_point,
    run,
    run_and_kill_at,
    train_command,
    train_env,
)

pytestmark = pytest.mark.slow


def _shard_files(folder) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


@pytest.fixture(scope="module")
def one_process(shapes_mds, tmp_path_factory):
    """The same run on one process (unsharded, the global batch of 16 as two microbatches of 8), a
    checkpoint file per batch."""
    out = tmp_path_factory.mktemp("one-process")
    result = run(train_command(1, out, shapes_mds, *COMMON, recipe=RECIPE), REPO, train_env())
    assert result.returncode == 0, result.stderr[-3000:]
    assert "1 devices x 16 per device (microbatch 8, gradient accumulation 2)" in result.stderr
    return out


def test_sharded_run_trains_like_the_one_process_run_and_saves_sharded_checkpoints(
    mmdit_reference, one_process
):
    """The recipe's training draws are keyed per sample (model.train_draws: sample,
    models/engine/draw_keys.py), so each sample gets the same noise, timestep and caption dropout on one
    process or two, and every batch's loss over the whole batch agrees to fp32 rounding (the sharded
    run averages gradients by a reduce-scatter, recomputes every block in the backward pass and sums
    in another order)."""
    sharded, tmp_path = mmdit_reference("shard-2"), one_process
    want = read_loss_log(tmp_path / "loss.jsonl", "total")
    got = read_loss_log(sharded / "loss.jsonl", "total")
    assert sorted(want) == sorted(got) == list(range(1, BATCHES + 1))
    for batch, loss in want.items():
        assert got[batch] == pytest.approx(loss, rel=1e-5, abs=1e-6), (batch, got, want)
    assert got[BATCHES] != got[1]  # it trained
    ref, mine = torch.load(sharded / "unet-rank0.pt"), torch.load(tmp_path / "unet-rank0.pt")
    distance = max((ref[k] - mine[k]).abs().max().item() for k in ref)
    assert distance < 1e-6, distance

    # Checkpoints: a folder per batch, torch distributed checkpoint's file per rank and its metadata.
    folders = sorted(p.name for p in (sharded / "ckpt").iterdir() if p.is_dir() and not p.is_symlink())
    assert folders == [f"ep{(b - 1) // 4}-ba{b}" for b in range(1, BATCHES + 1)]
    last = sharded / "ckpt" / folders[-1]
    assert _shard_files(last) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    metadata = FileSystemReader(str(last)).read_metadata().state_dict_metadata
    name = "transformer.transformer_blocks.0.attn.to_q.weight"
    for key in (f"state.model.{name}", f"state.callbacks.EMAShards.ema.{name}"):
        assert len(metadata[key].chunks) == 2, key  # half of it from each rank: the model and the EMA
    assert ["state.optimizers" in k for k in metadata].count(True) > 0
    assert not any("_checkpoint_wrapped_module" in k for k in metadata)  # names as without recomputing


def test_sigkill_and_rerun_ends_bitwise_equal(mmdit_reference, shapes_mds, tmp_path):
    kill_at, delay, why = kill_point(2, BATCHES - 2)
    command = mmdit_command("shard-2", tmp_path, shapes_mds)
    run_and_kill_at(command, REPO, train_env(), tmp_path / "loss.jsonl", kill_at, delay)
    again = run(command, REPO, train_env())
    assert again.returncode == 0, f"{why}: " + again.stderr[-3000:]
    assert "the newest complete checkpoint" in again.stderr, why
    assert_same_run(mmdit_reference("shard-2"), tmp_path, why, BATCHES)


def test_a_sharded_checkpoint_continues_on_one_process(mmdit_reference, shapes_mds, tmp_path):
    """A node lost: the 2-process run's checkpoint of batch 4 continues under one process (no
    `parallelism.shard`: the sharded checkpoint keeps it sharded, over 1 GPU), with the global batch of
    16 as two microbatches of 8 instead of one per rank, on the same samples in the same order, with
    the same per-sample draws: it continues the same run, to fp32 rounding."""
    reference = mmdit_reference("shard-2")
    shutil.copytree(reference / "ckpt" / "ep0-ba4", tmp_path / "ckpt" / "ep0-ba4")
    command = train_command(1, tmp_path, shapes_mds, *COMMON, recipe=RECIPE)
    result = run(command, REPO, train_env())
    assert result.returncode == 0, result.stderr[-3000:]
    assert "resumes a sharded checkpoint" in result.stderr
    assert (
        "global batch 16 = 1 devices x 16 per device (microbatch 8, gradient accumulation 2)" in result.stderr
    )
    losses, want_losses = (
        read_loss_log(tmp_path / "loss.jsonl", "total"),
        read_loss_log(reference / "loss.jsonl", "total"),
    )
    assert sorted(losses) == list(range(5, BATCHES + 1))
    for batch, loss in losses.items():
        assert loss == pytest.approx(want_losses[batch], rel=1e-5, abs=1e-6), (batch, losses, want_losses)
    keys, want = read_key_log(tmp_path / "keys.jsonl"), read_key_log(reference / "keys.jsonl")
    assert [set(keys[b]) for b in losses] == [set(want[b]) for b in losses]
    assert _shard_files(tmp_path / "ckpt" / f"ep1-ba{BATCHES}") == [".metadata", "__0_0.distcp"]
    # It trained on from the checkpoint to the 2-process run's weights, but for rounding.
    got, ref = torch.load(tmp_path / "unet-rank0.pt"), torch.load(reference / "unet-rank0.pt")
    distance = max((got[k] - ref[k]).abs().max().item() for k in ref)
    assert distance < 1e-6, distance


def test_a_one_process_checkpoint_file_continues_sharded_on_two(one_process, shapes_mds, tmp_path):
    """The other direction (issue 47): the one-process run's checkpoint file of batch 4 continues
    under `composer -n 2` of the sharding recipe (Composer loads a sharded run from a folder only:
    recipes/file_to_sharded.py writes the file sharded in the temp space first), ends at the
    uninterrupted run's losses, weights and EMA but for rounding, and saves sharded checkpoints."""
    (tmp_path / "ckpt").mkdir()
    shutil.copy(one_process / "ckpt" / "ep0-ba4-rank0.pt", tmp_path / "ckpt")
    result = run(mmdit_command("shard-2", tmp_path, shapes_mds), REPO, train_env())
    assert result.returncode == 0, result.stderr[-3000:]
    assert "a sharded run loads the checkpoint file" in result.stderr
    losses, want = (read_loss_log(p / "loss.jsonl", "total") for p in (tmp_path, one_process))
    assert sorted(losses) == list(range(5, BATCHES + 1))
    for batch, loss in losses.items():
        assert loss == pytest.approx(want[batch], rel=1e-5, abs=1e-6), (batch, losses, want)
    for weights in ("unet-rank0.pt", "ema-rank0.pt"):
        got, ref = torch.load(tmp_path / weights), torch.load(one_process / weights)
        assert max((got[k] - ref[k]).abs().max().item() for k in ref) < 1e-6, weights
    assert _shard_files(tmp_path / "ckpt" / f"ep1-ba{BATCHES}") == [
        ".metadata",
        "__0_0.distcp",
        "__1_0.distcp",
    ]
    assert (tmp_path / "ckpt" / "ep0-ba4-rank0.pt").read_bytes() == (
        one_process / "ckpt" / "ep0-ba4-rank0.pt"
    ).read_bytes()


def test_hsdp_on_four_processes_trains_and_resumes_bitwise(mmdit_reference, shapes_mds, tmp_path):
    """2 copies x 2 shards: only the first copy writes (2 shard files), and a run continued from the
    HSDP checkpoint of batch 3 ends as the uninterrupted one: every later loss, the weights and the EMA.
    (A copy of the checkpoint, not a kill: the 2-process tests kill; 4 processes on 2 cores are dear.)"""
    reference = mmdit_reference("hsdp-2x2")
    last = reference / "ckpt" / f"ep1-ba{BATCHES}"
    assert _shard_files(last) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    shutil.copytree(reference / "ckpt" / "ep0-ba3", tmp_path / "ckpt" / "ep0-ba3")
    result = run(mmdit_command("hsdp-2x2", tmp_path, shapes_mds), REPO, train_env())
    assert result.returncode == 0, result.stderr[-3000:]
    assert "2 CPU process(es) x 2 copies (HSDP)" in result.stderr
    want = read_loss_log(reference / "loss.jsonl")
    assert read_loss_log(tmp_path / "loss.jsonl") == {b: want[b] for b in range(4, BATCHES + 1)}
    for name in ("unet-rank0.pt", "ema-rank0.pt"):
        got, ref = torch.load(tmp_path / name), torch.load(reference / name)
        assert got.keys() == ref.keys() and all(torch.equal(got[k], ref[k]) for k in ref), name
