"""Several sets in one run (`data.train.streams`), aspect-ratio buckets, streaming settings, and the
config errors for each, all before anything is built."""

import gc
import json
import random
from collections import Counter
from pathlib import Path

import pytest
from PIL import Image

from convert.__main__ import main as sd_convert
from recipes import ConfigError, build_trainer, load_config, parse_config
from tests.conftest import REPO, merged, shared_folder, tiny_run
from tests.probes import read_key_log

# (aspect label, width x height, images): 24 + 16 + 8 = 48 samples, buckets of 3, 2 and 1 batches of 8
BUCKETS = [("ar0.75", (36, 48), 24), ("ar1", (40, 40), 16), ("ar1.33333", (48, 36), 8)]


@pytest.fixture(scope="session")
def bucketed_mds(tmp_path_factory) -> Path:
    """`sd-convert folder --buckets` output of images in three aspect ratios (shared by processes)."""

    def build(root: Path) -> None:
        rng = random.Random(0)
        images = root / "images"
        images.mkdir()
        for label, size, count in BUCKETS:
            for i in range(count):
                color = tuple(rng.randrange(256) for _ in range(3))
                Image.new("RGB", size, color).save(images / f"{label}-{i:03d}.png")
                (images / f"{label}-{i:03d}.txt").write_text(f"a {label} picture number {i}")
        ratios = ",".join(label.removeprefix("ar") for label, _, _ in BUCKETS)
        argv = ["folder", "--src", str(images), "--out", str(root / "mds"), "--buckets", ratios]
        assert sd_convert([*argv, "--work-dir", str(root / "work")]) == 0

    return shared_folder(tmp_path_factory, "bucketed", build) / "mds"


def _overrides(*extra):
    return merged(*tiny_run(Path("/unused"), 1)[1:], *extra)  # tiny_run's, without its data.train.local


def _config(*overrides):
    return parse_config(load_config(REPO / "yamls/tiny-cpu.yaml", ["~data.train.prepare", *overrides]))


@pytest.mark.parametrize(
    "overrides, match",
    [
        (
            [
                "data.train.local=null",
                "+data.train.streams={a: {local: /x, proportion: 0.7}, b: {local: /y, proportion: 0.2}}",
            ],
            r"data.train.streams: the proportions add up to 0.9 \(a 0.7 \+ b 0.2\), not 1",
        ),
        (
            [
                "data.train.local=null",
                "+data.train.streams={a: {local: /x, proportion: 1.0}, b: {local: /y}}",
            ],
            "data.train.streams: when one stream has a proportion, every stream needs one",
        ),
        (
            ["data.train.local=null", "+data.train.streams={a: {local: /x, proportion: 0.5, repeat: 2}}"],
            r"data.train.streams.a: give one of proportion, repeat, choose, not \['proportion', 'repeat'\]",
        ),
        (
            ["data.train.local=null", "+data.train.streams={a: {lcoal: /x}}"],
            r"data.train.streams.a: unknown keys \['lcoal'\]",
        ),
        (["+data.train.streams={a: {local: /x}}"], "data.train.streams: give either streams or local/remote"),
        (["data.train.sampling_method=balance"], "data.train.sampling_method='balance'; choose one of"),
        (["data.train.batching_method=per-stream"], "data.train.batching_method='per-stream'; choose one of"),
        (["data.train.shuffle_algo=py9"], "data.train.shuffle_algo='py9'; choose one of"),
        (["data.train.cache_limit=lots"], "data.train.cache_limit='lots' is not a size"),
        (["data.train.predownload=0"], "data.train.predownload must be a positive integer"),
        (["+data.train.buckets=true"], "data.train.buckets: true needs batching_method: per_stream"),
    ],
)
def test_a_wrong_data_setting_is_a_config_error_naming_the_key(overrides, match):
    with pytest.raises(ConfigError, match=match):
        _config(*overrides)


def test_base_sets_streamings_settings_and_sd2_a_cache_limit():
    tiny = _config().data.train
    assert (tiny.download_timeout, tiny.sampling_method, tiny.batching_method, tiny.shuffle_algo) == (
        60,
        "balanced",
        "random",
        "py1e",
    )
    assert tiny.cache_limit is None
    from tests.test_recipes_yaml import REQUIRED

    sd2 = parse_config(load_config(REPO / "yamls/sd2-base.yaml", REQUIRED["sd2-base"])).data.train
    assert sd2.cache_limit == "500gb"


def test_an_empty_or_unreadable_stream_is_named_before_anything_is_built(shapes_mds, tmp_path, nothing_built):
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "index.json").write_text(json.dumps({"version": 2, "shards": []}))
    streams = f"{{shapes: {{local: {shapes_mds / 'mds'}}}, mine: {{local: {empty}}}}}"
    with pytest.raises(ConfigError, match=f"data.train: streams.mine: {empty} holds no samples"):
        build_trainer(
            load_config(
                REPO / "yamls/tiny-cpu.yaml",
                _overrides("data.train.local=null", f"+data.train.streams={streams}"),
            )
        )
    gone = "s3://no-such-bucket-here/set"
    streams = (
        f"{{shapes: {{local: {shapes_mds / 'mds'}}}, far: {{remote: '{gone}', local: {tmp_path / 'cache'}}}}}"
    )
    overrides = _overrides(
        "data.train.local=null", f"+data.train.streams={streams}", "data.train.download_timeout=2"
    )
    with pytest.raises(ConfigError, match=f"data.train: streams.far: cannot read {gone}/index.json"):
        build_trainer(load_config(REPO / "yamls/tiny-cpu.yaml", overrides))


def test_a_bucket_size_the_model_cannot_take_is_named(bucketed_mds, nothing_built):
    overrides = _overrides(
        f"data.train.local={bucketed_mds}",
        "+data.train.buckets=true",
        "data.train.batching_method=per_stream",
        "+data.train.bucket_sizes={ar0.75: [44, 30]}",
    )
    with pytest.raises(
        ConfigError, match=r"bucket_sizes.ar0.75=\[44, 30\]: each side must be a multiple of 8"
    ):
        build_trainer(load_config(REPO / "yamls/tiny-cpu.yaml", overrides))


def _train(save, batches, *extra):
    trainer = build_trainer(
        load_config(
            REPO / "yamls/tiny-cpu.yaml",
            _overrides(
                "global_train_batch_size=8",
                f"trainer.max_duration={batches}ba",
                f"trainer.save_folder={save}",
                "trainer.save_interval=3ba",
                "trainer.autoresume=true",
                "data.train.hflip=false",
                f"+callbacks.keys={{_target_: tests.probes.KeyLog, path: {save / 'keys.jsonl'}}}",
                f"+callbacks.shapes={{_target_: tests.probes.ShapeLog, path: {save / 'shapes.jsonl'}}}",
                *extra,
            ),
        )
    )
    trainer.fit()
    trainer.close()
    del trainer
    gc.collect()  # release the streaming dataset's shared memory before the next run opens it


def _shapes(save) -> list:
    return [tuple(json.loads(line)["shape"]) for line in (save / "shapes.jsonl").read_text().splitlines()]


def _bucketed(mds) -> list[str]:
    return [
        f"data.train.local={mds}",
        "+data.train.buckets=true",
        "data.train.batching_method=per_stream",
        "data.train.num_canonical_nodes=2",  # the same global order on 1 and 2 processes
    ]


@pytest.fixture(scope="module")
def straight_bucketed_run(bucketed_mds, tmp_path_factory) -> Path:
    straight = tmp_path_factory.mktemp("straight")
    _train(straight, 6, *_bucketed(bucketed_mds))  # one epoch: 48 samples, 6 batches
    return straight


def test_buckets_train_at_their_own_sizes_in_proportion_and_resume_exactly(
    bucketed_mds, straight_bucketed_run, tmp_path
):
    bucketed = _bucketed(bucketed_mds)
    straight, resumed = straight_bucketed_run, tmp_path / "resumed"
    shapes = _shapes(straight)
    # Every batch is one bucket at its size ((height, width), multiples of 8 around 32x32 pixels) ...
    assert set(shapes) == {(8, 3, 40, 24), (8, 3, 32, 32), (8, 3, 24, 40)}
    # ... and the buckets are drawn in proportion to their sizes: 24, 16 and 8 samples.
    assert Counter(shapes) == {(8, 3, 40, 24): 3, (8, 3, 32, 32): 2, (8, 3, 24, 40): 1}
    keys = read_key_log(straight / "keys.jsonl")
    for batch, batch_keys in keys.items():  # one bucket per batch, by the keys too
        assert len({k.split("-")[0] for k in batch_keys}) == 1, (batch, batch_keys)
    _train(resumed, 3, *bucketed)
    _train(resumed, 6, *bucketed)
    assert read_key_log(resumed / "keys.jsonl") == keys  # the resumed run continues the same order


@pytest.mark.fit
def test_two_streams_are_drawn_in_their_proportions(shapes_mds, bucketed_mds, tmp_path):
    # The shapes set (64 samples, square) at 25% and the bucketed one read without buckets (48,
    # square crops) at 75%: an epoch of the two sets' total (112) has 28 and 84 samples.
    streams = (
        f"{{shapes: {{local: {shapes_mds / 'mds'}, proportion: 0.25}}, "
        f"other: {{local: {bucketed_mds}, proportion: 0.75}}}}"
    )
    _train(tmp_path, 14, "data.train.local=null", f"+data.train.streams={streams}")
    keys = [k for batch in read_key_log(tmp_path / "keys.jsonl").values() for k in batch]
    assert len(keys) == 112
    from_bucketed = sum(k.startswith("ar") for k in keys)
    assert (len(keys) - from_bucketed, from_bucketed) == (28, 84)


def test_two_processes_see_the_same_bucketed_batches_as_one(bucketed_mds, straight_bucketed_run, tmp_path):
    from tests.resume_check import LAUNCH, run, train_env

    overrides = _overrides(
        "global_train_batch_size=8",
        "trainer.max_duration=6ba",
        f"trainer.save_folder={tmp_path / 'ckpt'}",
        "data.train.hflip=false",
        f"+callbacks.keys={{_target_: tests.probes.KeyLog, path: {tmp_path / 'keys.jsonl'}}}",
        *_bucketed(bucketed_mds),
    )
    cmd = [*LAUNCH, "-n", "2", str(REPO / "train.py"), str(REPO / "yamls/tiny-cpu.yaml"), *overrides]
    result = run(cmd, REPO, train_env(), timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    one = read_key_log(straight_bucketed_run / "keys.jsonl")
    two = read_key_log(tmp_path / "keys.jsonl")
    assert sorted(one) == sorted(two) == list(range(1, 7))
    assert [set(one[b]) for b in one] == [set(two[b]) for b in one]
