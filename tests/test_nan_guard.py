"""NaN/Inf loss: the run stops naming the batch, keeps the last good state, and rerunning resumes from it."""

import gc
import random
from types import SimpleNamespace

import pytest
import torch

from extensions.callbacks import NaNGuard, NonFiniteLossError
from recipes import build_trainer, load_config
from tests.conftest import REPO

BATCHES = 5


def _trainer(shapes_mds, save, *extra):
    overrides = [
        f"data.train.local={shapes_mds / 'mds'}",
        "~data.train.prepare",
        "model.pretrained=null",
        "global_train_batch_size=16",
        f"trainer.max_duration={BATCHES}ba",
        f"trainer.save_folder={save}",
        "trainer.save_interval=1000ba",  # no interval checkpoint: the guard's is the only one
        "callbacks.samples=null",
        "trainer.autoresume=true",
        "trainer.progress_bar=false",
        *extra,
    ]
    return build_trainer(load_config(REPO / "yamls/tiny-cpu.yaml", overrides))


def _finite(state_dict: dict) -> bool:
    return all(
        torch.isfinite(v).all() for v in state_dict.values() if torch.is_tensor(v) and v.is_floating_point()
    )


@pytest.mark.fit
def test_nan_stops_naming_the_batch_and_rerun_resumes_from_last_good(shapes_mds, tmp_path):
    bad = random.Random().randint(2, BATCHES - 1)  # chosen afresh each run
    trainer = _trainer(
        shapes_mds,
        tmp_path,
        f"+callbacks.poison={{_target_: tests.probes.PoisonBatch, batch: {bad}}}",
        "+trainer.device_train_microbatch_size=8",  # two microbatches: the guard reads its flag once
    )
    assert any(isinstance(cb, NaNGuard) for cb in trainer.state.callbacks)  # from yamls/_base.yaml
    with pytest.raises(NonFiniteLossError, match=f"loss is not finite at batch {bad};") as err:
        trainer.fit()
    saved = tmp_path / f"last-good-ba{bad - 1}-rank0.pt"
    assert str(saved) in str(err.value)
    # The NaN batch never reached the optimizer: the weights in memory and on disk are still finite.
    assert _finite(trainer.state.model.state_dict())
    checkpoint = torch.load(saved, weights_only=False)["state"]
    assert checkpoint["timestamp"]["Timestamp"]["batch"] == bad - 1
    assert _finite(checkpoint["model"])
    assert (tmp_path / "latest-rank0.pt").resolve() == saved.resolve()
    trainer.close()
    del trainer
    gc.collect()  # release the streaming dataset (its shared memory) before the rerun opens it again

    # Rerunning the same command (autoresume), once the cause is gone, resumes from the last good state.
    rerun = _trainer(shapes_mds, tmp_path)
    assert int(rerun.state.timestamp.batch) == bad - 1
    rerun.fit()
    assert int(rerun.state.timestamp.batch) == BATCHES
    assert _finite(rerun.state.model.state_dict())
    rerun.close()


def _state(loss=None, saver=None):
    return SimpleNamespace(
        loss=loss, timestamp=SimpleNamespace(batch=6), callbacks=[saver] if saver else [], device=None
    )


def _batch(guard, *losses, saver=None):
    """One batch as Composer runs it: a loss per microbatch, then AFTER_TRAIN_BATCH (before the step)."""
    state = _state(saver=saver)
    guard.before_train_batch(state, None)
    for loss in losses:
        state.loss = loss
        guard.after_loss(state, None)
    guard.after_train_batch(state, None)


@pytest.mark.parametrize(
    "loss",
    [
        torch.tensor(float("nan")),
        torch.tensor([1.0, float("inf")]),
        {"mse": torch.tensor(1.0), "kl": torch.tensor(float("nan"))},
    ],
)
def test_guard_stops_on_nan_or_inf_in_any_loss(loss):
    with pytest.raises(NonFiniteLossError, match="^loss is not finite at batch 7$"):  # no saver: no file
        _batch(NaNGuard(), torch.tensor(1.0), loss, torch.tensor(2.0))  # the bad one is microbatch 2 of 3


def test_check_inf_false_stops_on_nan_only():
    guard = NaNGuard(check_inf=False)
    _batch(guard, torch.tensor(float("inf")))
    with pytest.raises(NonFiniteLossError):
        _batch(guard, torch.tensor(float("nan")))
    _batch(NaNGuard(), torch.tensor(2.5))  # finite: nothing happens


def test_a_bad_microbatch_does_not_carry_over_to_the_next_batch():
    guard = NaNGuard()
    with pytest.raises(NonFiniteLossError):
        _batch(guard, torch.tensor(float("nan")))
    guard.before_train_batch(_state(), None)  # e.g. Composer retrying the batch after an OOM
    _batch(guard, torch.tensor(1.0), torch.tensor(1.0))


def test_one_collective_and_one_host_read_per_batch_whatever_the_microbatches(monkeypatch):
    from composer.utils import dist

    calls = {"all_reduce": 0, "item": 0, "bool": 0}

    def all_reduce(tensor, reduce_operation):
        assert reduce_operation == "MAX"
        calls["all_reduce"] += 1

    def counting(name, real):
        def wrapper(self, *args):
            calls[name] += 1
            return real(self, *args)

        return wrapper

    monkeypatch.setattr(dist, "get_world_size", lambda: 8)
    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    monkeypatch.setattr(torch.Tensor, "item", counting("item", torch.Tensor.item))
    monkeypatch.setattr(torch.Tensor, "__bool__", counting("bool", torch.Tensor.__bool__))
    guard = NaNGuard()
    state = _state()
    state.device = SimpleNamespace(tensor_to_device=lambda t: t)
    for microbatches in (1, 4, 32):  # sd2-base at 8 GPUs runs 32 per step
        calls.update(all_reduce=0, item=0, bool=0)
        guard.before_train_batch(state, None)
        for _ in range(microbatches):
            state.loss = torch.tensor(0.5)
            guard.after_loss(state, None)
        assert calls == {"all_reduce": 0, "item": 0, "bool": 0}  # nothing leaves the device per microbatch
        guard.after_train_batch(state, None)
        assert calls == {"all_reduce": 1, "item": 1, "bool": 0}


def test_save_last_good_false_saves_nothing(monkeypatch, tmp_path):
    from composer.utils import checkpoint

    class CheckpointSaver:  # the guard finds composer's saver by class name
        folder = str(tmp_path)

    monkeypatch.setattr(checkpoint, "save_checkpoint", lambda *a, **k: pytest.fail("saved a checkpoint"))
    with pytest.raises(NonFiniteLossError, match="^loss is not finite at batch 7$"):
        _batch(NaNGuard(save_last_good=False), torch.tensor(float("nan")), saver=CheckpointSaver())
    assert not list(tmp_path.iterdir())


@pytest.mark.fit
@pytest.mark.subprocess
def test_a_nan_on_one_rank_stops_every_rank_together(shapes_mds, tmp_path):
    """Under `composer -n 2` only rank 1's batch is poisoned: both ranks stop at that batch (the
    guard's one all-reduce per batch), the last good state is saved, and nothing hangs."""
    from tests.resume_check import COMPOSER, run, train_env

    bad = 3
    cmd = [
        COMPOSER,
        "-n",
        "2",
        str(REPO / "train.py"),
        str(REPO / "yamls/tiny-cpu.yaml"),
        f"data.train.local={shapes_mds / 'mds'}",
        "~data.train.prepare",
        "model.pretrained=null",
        "global_train_batch_size=16",
        "+trainer.device_train_microbatch_size=4",  # two microbatches per rank
        f"trainer.max_duration={BATCHES}ba",
        f"trainer.save_folder={tmp_path}",
        "trainer.save_interval=1000ba",
        "callbacks.samples=null",
        "trainer.progress_bar=false",
        f"+callbacks.poison={{_target_: tests.probes.PoisonBatch, batch: {bad}, rank: 1}}",
    ]
    result = run(cmd, REPO, train_env(), timeout=300)
    logs = result.stdout + result.stderr
    assert result.returncode != 0, logs[-3000:]
    assert logs.count(f"loss is not finite at batch {bad}") >= 2, logs[-3000:]  # one per rank
    saved = torch.load(tmp_path / f"last-good-ba{bad - 1}-rank0.pt", weights_only=False)["state"]
    assert saved["timestamp"]["Timestamp"]["batch"] == bad - 1 and _finite(saved["model"])


@pytest.mark.slow
def test_a_sharded_run_saves_its_last_good_checkpoint_folder_and_resumes_from_it(shapes_mds, tmp_path):
    """`parallelism.shard=2`, no interval checkpoint: the guard saves the last good state as a sharded
    checkpoint folder (Composer names it as the interval checkpoints), named whole in the message and
    by the `latest` link (rank 0's, as Composer links sharded checkpoints). Rerunning the command
    without the poison resumes from it and finishes. (An interval checkpoint of that batch already
    there is kept: the test below.)"""
    from models.checkpoints.sharded_checkpoint import check_complete
    from tests.resume_check import COMPOSER, run, train_env

    bad = 3
    cmd = [
        COMPOSER,
        "-n",
        "2",
        str(REPO / "train.py"),
        str(REPO / "yamls/tiny-mmdit-cpu.yaml"),
        f"data.train.local={shapes_mds / 'mds'}",
        "~data.train.prepare",
        "model.pretrained=null",  # a random VAE: not the stage-1 VAE, which the run would train first
        "global_train_batch_size=16",
        f"trainer.max_duration={BATCHES}ba",
        f"trainer.save_folder={tmp_path}",
        "trainer.save_interval=1000ba",  # none: the guard writes the folder
        "trainer.autoresume=true",
        "callbacks.samples=null",
        "trainer.progress_bar=false",
        "parallelism.shard=2",
    ]
    poison = f"+callbacks.poison={{_target_: tests.probes.PoisonBatch, batch: {bad}, rank: 1}}"
    result = run([*cmd, poison], REPO, train_env(), timeout=300)
    logs = result.stdout + result.stderr
    assert result.returncode != 0, logs[-3000:]
    folder = tmp_path / f"ep0-ba{bad - 1}"
    assert (
        f"loss is not finite at batch {bad}; the weights after batch {bad - 1} are saved in {folder}\n"
        in logs
    )
    check_complete(folder)
    assert (tmp_path / "latest-rank0.pt").resolve() == folder.resolve()
    assert not (tmp_path / "latest-rank1.pt").exists()
    metadata = (folder / ".metadata").stat().st_mtime_ns

    again = run(cmd, REPO, train_env(), timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"resuming from {folder}, the newest complete checkpoint" in again.stderr
    assert (folder / ".metadata").stat().st_mtime_ns == metadata
    check_complete(tmp_path / f"ep1-ba{BATCHES}")


def test_a_sharded_last_good_state_keeps_the_interval_checkpoint_of_its_batch(tmp_path, monkeypatch):
    """Sharded, the guard's save would go into the interval checkpoint's folder of the same batch: a
    complete one is kept as it is (rewriting its shards in place could tear it) and linked; a torn
    one (no .metadata) is saved anew. One process, torch distributed checkpoint without a group."""
    import torch.distributed.checkpoint as dcp
    from composer.core import Timestamp

    from extensions import callbacks

    folder = tmp_path / "ep0-ba2"
    dcp.save({"w": torch.ones(3)}, checkpoint_id=str(folder))
    saves = []
    monkeypatch.setattr(callbacks.checkpoint, "save_checkpoint", lambda state, name: saves.append(name))
    state = SimpleNamespace(
        fsdp_sharded_state_dict_enabled=True,
        fsdp_config=SimpleNamespace(sharded_ckpt_prefix_dir="ep{epoch}-ba{batch}"),
        run_name="run",
        timestamp=Timestamp(epoch=0, batch=2),
    )
    saver = SimpleNamespace(
        latest_filename=SimpleNamespace(format=lambda state: str(tmp_path / "latest-rank0.pt"))
    )
    assert callbacks._save_last_good(state, saver, tmp_path, 2) == folder
    assert saves == [] and (tmp_path / "latest-rank0.pt").resolve() == folder.resolve()

    (folder / ".metadata").unlink()  # a save cut short: not a checkpoint, saved again
    assert callbacks._save_last_good(state, saver, tmp_path, 2) == folder
    assert saves == [str(tmp_path / "last-good-ba2-rank{rank}.pt")]
