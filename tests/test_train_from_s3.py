"""Training from a dataset that lives only in S3 (the SeaweedFS test server), starting from an empty
local cache, as every run on a fresh node does: one set, two streams, and aspect-ratio buckets. Each
run must see exactly the batches the same run sees from the local copy of the set."""

import gc
from pathlib import Path

import pytest

from recipes import build_trainer, load_config
from tests.conftest import REPO, tiny_run
from tests.probes import read_key_log
from tests.s3_server import BUCKET, s3_server  # noqa: F401  (fixture)
from tests.test_streams import bucketed_mds  # noqa: F401  (fixture)

pytestmark = pytest.mark.slow

S3_VARIABLES = ("S3_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION")


def upload_folder(server, folder: Path, prefix: str) -> str:
    """Every file under `folder` to s3://BUCKET/prefix/..., as `sd-convert --out s3://` leaves it."""
    client = server.client()
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        client.upload_file(str(path), BUCKET, f"{prefix}/{path.relative_to(folder).as_posix()}")
    return f"s3://{BUCKET}/{prefix}"


@pytest.fixture(scope="module")
def remote_sets(s3_server, shapes_mds, bucketed_mds):  # noqa: F811
    """The shapes and bucketed sets uploaded to the server; the S3 variables set for this module."""
    with pytest.MonkeyPatch.context() as patch:
        for name in S3_VARIABLES:
            patch.setenv(name, s3_server.env()[name])
        yield {
            "shapes": upload_folder(s3_server, shapes_mds / "mds", "train-from-s3/shapes"),
            "bucketed": upload_folder(s3_server, bucketed_mds, "train-from-s3/bucketed"),
        }


def _train(out: Path, batches: int, *data: str) -> None:
    out.mkdir(parents=True)
    overrides = [
        *tiny_run(Path("/unused"), batches)[1:],  # without its data.train.local
        "global_train_batch_size=8",
        "data.train.hflip=false",
        "data.train.num_canonical_nodes=2",
        f"+callbacks.keys={{_target_: tests.probes.KeyLog, path: {out / 'keys.jsonl'}}}",
        *data,
    ]
    trainer = build_trainer(load_config(REPO / "yamls/tiny-cpu.yaml", overrides))
    trainer.fit()
    assert int(trainer.state.timestamp.batch) == batches
    trainer.close()
    del trainer
    gc.collect()  # release the streaming dataset's shared memory before the next run opens it


def _compare(tmp_path, batches, remote_overrides, local_overrides) -> None:
    _train(tmp_path / "remote", batches, *remote_overrides)
    _train(tmp_path / "local", batches, *local_overrides)
    remote, local = read_key_log(tmp_path / "remote/keys.jsonl"), read_key_log(tmp_path / "local/keys.jsonl")
    assert sorted(remote) == list(range(1, batches + 1))
    assert remote == local


def test_one_remote_set_with_an_empty_cache(remote_sets, shapes_mds, tmp_path):
    cache = tmp_path / "cache"
    remote = [f"data.train.remote={remote_sets['shapes']}", f"data.train.local={cache}"]
    _compare(tmp_path, 3, remote, [f"data.train.local={shapes_mds / 'mds'}"])
    assert (cache / "index.json").is_file()
    assert list(cache.glob("shard.*.mds*")), "streaming downloaded no shard into the cache"


def test_two_remote_streams_with_empty_caches(remote_sets, shapes_mds, bucketed_mds, tmp_path):  # noqa: F811
    def streams(shapes, bucketed):
        return (
            "data.train.local=null",
            f"+data.train.streams={{shapes: {{{shapes}, proportion: 0.25}}, "
            f"other: {{{bucketed}, proportion: 0.75}}}}",
        )

    remote = streams(
        f"remote: '{remote_sets['shapes']}', local: {tmp_path / 'c1'}",
        f"remote: '{remote_sets['bucketed']}', local: {tmp_path / 'c2'}",
    )
    _compare(tmp_path, 4, remote, streams(f"local: {shapes_mds / 'mds'}", f"local: {bucketed_mds}"))


def test_remote_buckets_with_an_empty_cache(remote_sets, bucketed_mds, tmp_path):  # noqa: F811
    bucketed = ["+data.train.buckets=true", "data.train.batching_method=per_stream"]
    remote = [f"data.train.remote={remote_sets['bucketed']}", f"data.train.local={tmp_path / 'cache'}"]
    _compare(tmp_path, 6, [*remote, *bucketed], [f"data.train.local={bucketed_mds}", *bucketed])
    assert {p.name for p in (tmp_path / "cache").iterdir()} >= {"ar0.75", "ar1", "ar1.33333"}
