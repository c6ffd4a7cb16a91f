"""`data.train.holdout` keeps a fixed part of the training set out of training and evaluates it at
fixed timesteps; `trainer.keep_best` keeps the checkpoint with the lowest held-out loss, resume-safe."""

import gc
import json
import os

import numpy as np
import pytest
import torch
from composer.loggers import InMemoryLogger
from streaming.base.batching import generate_work
from streaming.base.world import World
from torch.utils.data import DistributedSampler

from data.holdout import HeldOut, held_out_ids
from data.loader import ImageCaptionDataConfig, build_image_caption_dataloader
from extensions.keep_best import BEST, RECORD, keep
from recipes import build_trainer, load_config, parse_config, train
from recipes.config import ConfigError
from tests.conftest import REPO, merged, tiny_run

HELD, BATCHES, EVERY = 16, 6, 2  # of the 64-sample shapes set: 48 train (3 batches of 16) and 16 held out
METRIC = "metrics/holdout/FixedTimestepLoss"


def _train_loader(shapes_mds, holdout=HELD):
    cfg = ImageCaptionDataConfig(
        local=str(shapes_mds / "mds"),
        resolution=32,
        holdout=holdout,
        num_canonical_nodes=2,
        shuffle_block_size=64,
    )
    return build_image_caption_dataloader(cfg, tokenizer=None, batch_size=8)  # ids only: nothing tokenized


def _trained_ids(dataset, ranks: int, epoch: int) -> list[set[int]]:
    """Each rank's sample ids of `epoch` as streaming partitions it over `ranks` processes of one node."""
    work = generate_work("random", dataset, World(1, ranks, 1, 0), epoch, 0)
    return [set(work[0, rank].flatten().tolist()) - {-1} for rank in range(ranks)]


def test_the_split_is_the_same_on_any_number_of_processes_and_disjoint(shapes_mds):
    held = held_out_ids(64, HELD)
    assert len(held) == len(set(held.tolist())) == HELD and held.min() >= 0 and held.max() < 64
    assert np.array_equal(held, held_out_ids(64, HELD))  # a function of (size, holdout) alone
    assert len(held_out_ids(64, 0.25)) == HELD and len(held_out_ids(1000, 0.001)) == 1
    assert len(held_out_ids(100_000, 0.05)) == 5000  # exactly, also where the chunked bound is used

    loader = _train_loader(shapes_mds)
    dataset = loader.dataset
    assert np.array_equal(dataset.held_out, held) and dataset.epoch_size == 64 - HELD
    assert len(dataset) == 64 - HELD  # one process's share of the shorter epoch
    for epoch in (0, 1):
        one, (first, second) = _trained_ids(dataset, 1, epoch)[0], _trained_ids(dataset, 2, epoch)
        assert one == first | second == set(range(64)) - set(held.tolist())  # the same samples trained
        assert not first & second

    # Evaluated: every held-out sample, split over the ranks as torch's DistributedSampler splits it.
    from data.loader import build_holdout_dataloader

    view = build_holdout_dataloader(loader, ImageCaptionDataConfig(holdout=HELD)).dataset
    assert isinstance(view, HeldOut) and len(view) == HELD
    by_rank = [
        {int(view.ids[i]) for i in DistributedSampler(view, ranks, rank, shuffle=False)}
        for ranks in (1, 2)
        for rank in range(ranks)
    ]
    assert by_rank[0] == by_rank[1] | by_rank[2] == set(held.tolist()) and not by_rank[1] & by_rank[2]


def test_held_out_samples_are_read_unflipped(shapes_mds):
    from models import build_model

    cfg = ImageCaptionDataConfig(local=str(shapes_mds / "mds"), resolution=32, holdout=HELD, hflip=True)
    dataset = build_image_caption_dataloader(cfg, build_model("tiny").tokenizer, 8).dataset
    plain = [dataset.unaugmented(int(i))["image"] for i in dataset.held_out]
    k = next(k for k, image in enumerate(plain) if not torch.equal(image, image.flip(-1)))  # asymmetric
    assert torch.equal(dataset._sample(int(dataset.held_out[k]), True)["image"], plain[k].flip(-1))
    assert all(torch.equal(HeldOut(dataset)[i]["image"], image) for i, image in enumerate(plain))


def test_the_kept_checkpoint_outlives_retention_and_replaces_the_last_atomically(tmp_path):
    for batch in (2, 4):
        (tmp_path / f"ep0-ba{batch}-rank0.pt").write_bytes(f"weights {batch}".encode())
    keep(tmp_path / "ep0-ba2-rank0.pt", tmp_path, {"batch": 2, "loss": 0.5})
    os.remove(tmp_path / "ep0-ba2-rank0.pt")  # retention deletes its own name
    assert (tmp_path / BEST / "checkpoint.pt").read_bytes() == b"weights 2"
    keep(tmp_path / "ep0-ba4-rank0.pt", tmp_path, {"batch": 4, "loss": 0.4})
    assert os.readlink(tmp_path / BEST) == "best-ba4" and not (tmp_path / "best-ba2").exists()
    assert os.path.samefile(tmp_path / BEST / "checkpoint.pt", tmp_path / "ep0-ba4-rank0.pt")  # a hard link
    record = json.loads((tmp_path / BEST / RECORD).read_text())
    assert record == {"batch": 4, "loss": 0.4, "checkpoint": "ep0-ba4-rank0.pt"}
    assert sorted(p.name for p in tmp_path.iterdir()) == [BEST, "best-ba4", "ep0-ba4-rank0.pt"]


def _config(shapes_mds, save, *extra):
    return load_config(
        REPO / "yamls/tiny-cpu.yaml",
        merged(
            *tiny_run(shapes_mds, BATCHES),
            f"data.train.holdout={HELD}",
            f"trainer.eval_interval={EVERY}ba",
            "trainer.keep_best=true",
            f"trainer.save_folder={save}",
            "trainer.save_interval=5ba",
            "trainer.save_num_checkpoints_to_keep=1",
            "scheduler.t_warmup=1ba",  # the full learning rate at once, so the loss moves within 6 batches
            "+loggers.memory={_target_: composer.loggers.InMemoryLogger}",
            *extra,
        ),
    )


def _logged(trainer, key: str) -> dict[int, float]:
    memory = next(d for d in trainer.logger.destinations if isinstance(d, InMemoryLogger))
    return {int(time.batch): float(value) for time, value in memory.data.get(key, [])}


@pytest.mark.fit
def test_a_run_logs_the_held_out_loss_and_keeps_its_best_checkpoint_across_a_resume(shapes_mds, tmp_path):
    save = tmp_path / "checkpoints"
    trainer = build_trainer(_config(shapes_mds, save))
    assert trainer.state.model.eval_timesteps == 8  # judged at MLPerf's fixed timesteps
    trainer.fit()
    losses, kept = _logged(trainer, METRIC), _logged(trainer, "keep_best/batch")
    trainer.close()
    del trainer
    gc.collect()
    assert sorted(losses) == list(range(EVERY, BATCHES + 1, EVERY)), losses
    best_batch = min(losses, key=losses.get)
    record = json.loads((save / BEST / RECORD).read_text())
    assert record["loss"] == min(losses.values()) and record["batch"] == best_batch
    assert record["metric"] == METRIC
    state = torch.load(save / BEST / "checkpoint.pt", weights_only=False)["state"]
    assert state["timestamp"]["Timestamp"]["batch"] == best_batch  # the checkpoint of that batch
    # Each improvement was saved and kept, also where save_interval (5ba) would have saved nothing.
    improved = [b for b in losses if losses[b] < min([v for a, v in losses.items() if a < b], default=9e9)]
    assert sorted(kept) == improved and improved[0] == EVERY, (losses, kept)
    # Retention as before (the newest one kept), plus the best saved where its interval did not.
    assert [p.name.split("-")[1] for p in save.glob("ep*.pt")] == [f"ba{BATCHES}"]

    # A rerun resumes at batch 6 and evaluates at 8 and 10: none beats the best so far, which it
    # remembers (here made unbeatable), so best/ stays as it was.
    (save / BEST / RECORD).write_text(json.dumps({**record, "loss": 0.0}))
    rerun = train(_config(shapes_mds, save, "trainer.max_duration=10ba"))
    assert sorted(_logged(rerun, METRIC)) == [8, 10]
    assert json.loads((save / BEST / RECORD).read_text())["batch"] == best_batch
    assert os.readlink(save / BEST) == f"best-ba{best_batch}"
    assert [p.name.split("-")[1] for p in save.glob("ep*.pt")] == ["ba10"]


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["data.train.holdout=0"], "data.train.holdout=0 must be more than 0: a fraction"),
        (["data.train.holdout=-3"], "data.train.holdout=-3 must be more than 0"),
        (["data.train.holdout=1.5"], "data.train.holdout=1.5 is a fraction of 1 or more"),
        (["data.train.holdout=1.0"], "data.train.holdout=1.0 is a fraction of 1 or more"),
        (["+data.eval={local: x, holdout: 4}"], "data.eval.holdout: data.eval is evaluated whole"),
        (["trainer.keep_best=true"], "'trainer.keep_best' is true but the run has no held-out loss"),
        (["trainer.keep_best=1"], "'trainer.keep_best' must be true or false"),
        (
            ["trainer.keep_best=true", "data.train.holdout=8", "trainer.save_folder=s3://bucket/run"],
            "'trainer.keep_best' needs a local trainer.save_folder",
        ),
        (
            ["trainer.keep_best=true", "data.train.holdout=8", "trainer.save_num_checkpoints_to_keep=0"],
            "'trainer.keep_best' needs the checkpoint it keeps",
        ),
        (
            [
                "data.train.holdout=8",
                "~data.train.local",
                "+data.train.streams={a: {local: x, proportion: 1}}",
            ],
            "data.train.holdout: streams.a draws a different part of its samples each epoch",
        ),
    ],
)
def test_a_holdout_or_keep_best_that_cannot_work_is_a_one_line_config_error(overrides, message):
    with pytest.raises(ConfigError) as caught:
        parse_config(load_config(REPO / "yamls/tiny-cpu.yaml", overrides))
    assert str(caught.value).startswith(message) and "\n" not in str(caught.value), str(caught.value)


@pytest.mark.parametrize(
    "holdout, message",
    [
        (64, "data.train.holdout=64 holds out 64 of the set's 64 samples, leaving none to train on"),
        (100, "data.train.holdout=100 holds out 100 of the set's 64 samples, leaving none to train on"),
        (0.999, "data.train.holdout=0.999 holds out 64 of the set's 64 samples"),
        (56, "data.train: an epoch holds 8 samples, fewer than one global batch"),  # 64 - 56 < 16
    ],
)
def test_a_holdout_the_set_cannot_spare_is_one_line_before_anything_is_built(shapes_mds, holdout, message):
    overrides = [*tiny_run(shapes_mds, 1), f"data.train.holdout={holdout}"]
    with pytest.raises(ConfigError) as caught:
        build_trainer(load_config(REPO / "yamls/tiny-cpu.yaml", overrides))
    assert str(caught.value).startswith(message) and "\n" not in str(caught.value), str(caught.value)
