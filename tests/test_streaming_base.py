"""data/streaming_base.py: a set with no remote is iterated without streaming's download threads, in
exactly streaming's own sample order: shuffled, over epochs, in DataLoader workers, and when a
mid-epoch resume continues it. A set with a remote still goes through streaming's threads. Jobs
that start together on one host each get their own shared-memory prefix."""

import gc
import multiprocessing
import shutil

import pytest
from streaming import MDSWriter
from torch.utils.data import DataLoader

from compat.streaming import has_epoch_threads, stop_epoch_threads
from data.streaming_base import StreamingBase

N = 100


class Ids(StreamingBase):
    def __getitem__(self, index):
        return super().__getitem__(index)["id"]


@pytest.fixture(scope="module")
def ids_mds(tmp_path_factory):
    out = tmp_path_factory.mktemp("ids")
    with MDSWriter(out=str(out), columns={"id": "int"}, size_limit=400) as writer:  # 10 shards
        for i in range(N):
            writer.write({"id": i})
    assert len(list(out.glob("shard.*.mds"))) >= 5
    return out


def dataset(direct: bool, local, remote=None) -> Ids:
    ids = Ids(
        local=str(local), remote=remote, batch_size=4, shuffle=True, shuffle_seed=7, num_canonical_nodes=2
    )
    ids.iterate_local_directly = direct
    return ids


def close(ids: Ids) -> None:
    """Stop streaming's threads (they hold the dataset, and with it its local folder) and drop it."""
    stop_epoch_threads(ids, wait=True)
    gc.collect()


@pytest.mark.parametrize("workers", [0, pytest.param(2, marks=pytest.mark.subprocess)])
@pytest.mark.heavy
def test_the_order_is_streamings_own_over_two_epochs(ids_mds, workers):
    orders = {}
    for direct in (False, True):
        ids = dataset(direct, ids_mds)
        loader = DataLoader(ids, batch_size=4, num_workers=workers)
        orders[direct] = [[batch.tolist() for batch in loader] for _epoch in range(2)]
        if workers == 0:  # in this process: the threads ran only when asked for
            assert has_epoch_threads(ids) is not direct
        close(ids)
        del loader, ids
    first, second = orders[True]
    assert sorted(sum(first, [])) == list(range(N)) and first != second  # shuffled anew each epoch
    assert orders[True] == orders[False]


@pytest.mark.heavy
def test_a_mid_epoch_resume_continues_streamings_order(ids_mds):
    runs = {}
    for direct in (False, True):
        ids = dataset(direct, ids_mds)
        samples = iter(ids)
        head = [next(samples) for _ in range(37)]
        state = ids.state_dict(num_samples=37, from_beginning=True)
        close(ids)
        del samples, ids
        resumed = dataset(direct, ids_mds)
        resumed.load_state_dict(state)
        runs[direct] = head, list(resumed)
        close(resumed)
        del resumed
    head, tail = runs[True]
    assert sorted(head + tail) == list(range(N)) and len(tail) == N - 37
    assert runs[True] == runs[False]


def test_a_remote_set_still_downloads_through_streamings_threads(ids_mds, tmp_path):
    remote = tmp_path / "remote"
    shutil.copytree(ids_mds, remote)
    ids = dataset(True, tmp_path / "cache", remote=str(remote))
    assert sorted(ids) == list(range(N))
    assert has_epoch_threads(ids) and len(list((tmp_path / "cache").glob("shard.*.mds"))) >= 5
    close(ids)


def test_compressed_local_shards_are_decompressed_on_the_way(tmp_path):
    """Without threads to decompress ahead, `get_item` does it when a shard is first read."""
    with MDSWriter(out=str(tmp_path), columns={"id": "int"}, size_limit=400, compression="zstd") as writer:
        for i in range(N):
            writer.write({"id": i})
    assert not list(tmp_path.glob("shard.*.mds")) and list(tmp_path.glob("shard.*.mds.zstd"))
    ids = dataset(True, tmp_path)
    assert sorted(ids) == list(range(N)) and not has_epoch_threads(ids)
    close(ids)


def _build_datasets(locals_: list[str], start, failures) -> None:
    """In a fresh process (spawn: no conftest, so no retry): build a dataset per folder, kept."""
    kept = []
    start.wait(timeout=60)
    for local in locals_:
        try:
            kept.append(StreamingBase(local=local, batch_size=1))
        except FileExistsError:
            failures.put(local)


@pytest.mark.slow
def test_jobs_starting_together_on_one_host_each_get_a_prefix(ids_mds, tmp_path):
    """Three processes building eight datasets each at the same moment: with streaming's own class
    0-2 of each process's creates failed (FileExistsError on the same prefix); none here."""
    ctx = multiprocessing.get_context("spawn")
    start, failures = ctx.Barrier(3), ctx.Queue()
    jobs = []
    for job in range(3):
        folders = [str(shutil.copytree(ids_mds, tmp_path / f"{job}-{i}")) for i in range(8)]
        jobs.append(ctx.Process(target=_build_datasets, args=(folders, start, failures)))
    for process in jobs:
        process.start()
    for process in jobs:
        process.join(timeout=120)
    assert [p.exitcode for p in jobs] == [0, 0, 0]
    assert failures.empty()
