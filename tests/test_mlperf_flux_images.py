"""`sd-convert mlperf-flux-images` (convert/mlperf_flux_images.py): the MLPerf Flux.1 reference's image
sets, written here as its scripts write them (torchtitan 9603aa83 experiments/flux/scripts/):
coco_to_webdataset.py's tars ({image_id:012d}.png, .txt, an indented .json with the timestep) and
clean_cc12m.py's save_to_disk Arrow files (__key__, __url__, jpg, txt, json, png; images as datasets'
{bytes, path} structs). Converted, the images keep the reference's pixels byte for byte, COCO's
timestep travels through `sd-convert latents` into validation on both data paths, and the wrong set
gets one line."""

import io
import json
import tarfile

import numpy as np
import pyarrow as pa
import pytest
import torch
from PIL import Image

from data.latent_dataset import LatentsDataset
from data.loader import EvalDataConfig, build_image_caption_dataloader
from tests.convert_fixtures import run_cli
from tests.s3_server import BUCKET, s3_server  # noqa: F401  (s3_server is a fixture)
from tests.test_mlperf_flux import write_reference_set

PRESET, SIDE = "flux-tiny", 32  # the reference's are 256 px; flux-tiny trains at 32
IMAGE = pa.struct([("bytes", pa.binary()), ("path", pa.string())])  # datasets' Image feature
CC12M_SCHEMA = pa.schema(
    [
        ("__key__", pa.string()),
        ("__url__", pa.string()),
        ("jpg", IMAGE),
        ("json", pa.struct([("key", pa.string()), ("status", pa.string())])),
        ("txt", pa.string()),
        ("png", IMAGE),
    ]
)


def _png(seed: int, mode: str = "RGB", side: int = SIDE) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (side, side, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).convert(mode).save(buffer, format="PNG")  # PIL's save, as the scripts
    return buffer.getvalue()


def _add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))


def write_coco_webdataset(folder, samples: int, per_shard: int, bad: dict | None = None) -> list[dict]:
    """coco_to_webdataset.py's phase 2: shard_NNNNN.tar of png, txt and json per image, timestep i % 8
    in annotation-id order; `bad` replaces some samples' timesteps. Returns the samples."""
    folder.mkdir(parents=True)
    rows = []
    for i in range(samples):
        image_id = 1000 + 7 * i
        step = (bad or {}).get(i, i % 8)
        rows.append({"key": f"{image_id:012d}", "caption": f"a photo number {i}", "timestep": step,
                     "png": _png(i, "L" if i == 1 else "RGB")})  # fmt: skip
    for shard, start in enumerate(range(0, samples, per_shard)):
        with tarfile.open(folder / f"shard_{shard:05d}.tar", "w") as tar:
            for row in rows[start : start + per_shard]:
                meta = {"id": str(int(row["key"])), "caption": row["caption"], "timestep": row["timestep"],
                        "filename": f"COCO_val2014_{row['key']}.png"}  # fmt: skip
                _add(tar, f"{row['key']}.png", row["png"])
                _add(tar, f"{row['key']}.txt", row["caption"].encode())
                _add(tar, f"{row['key']}.json", json.dumps(meta, indent=2).encode())
    return rows


def write_cc12m_disk(folder, files: int, per_file: int, no_png: int | None = None) -> list[dict]:
    """clean_cc12m.py's save_to_disk folder: the webdataset's columns and the 256 px crop in png."""
    folder.mkdir(parents=True)
    rows = []
    for f in range(files):
        batch = []
        for i in range(f * per_file, (f + 1) * per_file):
            key = f"{i:09d}"
            png = None if i == no_png else {"bytes": _png(100 + i), "path": None}
            batch.append(
                {
                    "__key__": key,
                    "__url__": f"/dataset/cc12m-wds/cc12m-train-{f:04d}.tar",
                    "jpg": {"bytes": _png(500 + i, side=48), "path": None},  # the original, kept beside
                    "json": {"key": key, "status": "success"},
                    "txt": f"caption {i}",
                    "png": png,
                }
            )
        rows += batch
        table = pa.Table.from_pylist(batch, schema=CC12M_SCHEMA)
        with pa.OSFile(str(folder / f"data-{f:05d}-of-{files:05d}.arrow"), "wb") as sink:
            with pa.ipc.new_stream(sink, CC12M_SCHEMA) as writer:
                writer.write_table(table, max_chunksize=2)
    (folder / "state.json").write_text("{}")
    return rows


def _rows(out) -> dict[str, dict]:
    from streaming import StreamingDataset

    dataset = StreamingDataset(local=str(out), shuffle=False, batch_size=1)
    return {row["key"]: row for row in (dataset[i] for i in range(len(dataset)))}


@pytest.fixture(scope="module")
def coco(tmp_path_factory):
    """The COCO set converted to images, then to latents: (images, latents, the samples written)."""
    root = tmp_path_factory.mktemp("mlperf-images")
    rows = write_coco_webdataset(root / "coco", samples=18, per_shard=8, bad={3: 8, 5: None})
    assert run_cli("mlperf-flux-images", "--src", root / "coco", "--out", root / "images") == 0
    argv = ["latents", "--src", root / "images", "--out", root / "latents", "--preset", PRESET]
    assert run_cli(*argv, "--resolutions", SIDE) == 0
    return root / "images", root / "latents", rows


def test_the_coco_set_keeps_the_reference_s_pixels_captions_and_timesteps(coco):
    images, _, rows = coco
    written = _rows(images)
    kept = [row for i, row in enumerate(rows) if i not in (3, 5)]
    assert sorted(written) == [row["key"] for row in kept]
    for row in kept:
        assert written[row["key"]]["image"] == row["png"]  # 256 px PNGs need no resize: untouched
        assert written[row["key"]]["caption"] == row["caption"]
        assert written[row["key"]]["eval_timestep"] == row["timestep"]
    report = json.loads((images / "convert-report.json").read_text())
    assert report["samples_skipped"] == {"bad_timestep": 2}  # 8 is no level, None is no timestep


def test_the_timestep_travels_through_latents_into_validation_on_both_data_paths(coco):
    """Each sample is validated at t = i / 8 for the i its json stored, from the image set (images
    encoded on the fly) and from its `sd-convert latents` output alike."""
    from models import build_model
    from recipes.trainer import loader_inputs

    images, latents, rows = coco
    by_key = {row["key"]: row["timestep"] for row in rows}
    model = build_model(PRESET, eval_timesteps=8)
    config = EvalDataConfig(local=str(images), resolution=SIDE)
    loader = build_image_caption_dataloader(config, model.tokenizer, 4, 8, "eval", **loader_inputs(model))
    image_batch = next(iter(loader))
    image_keys = [loader.dataset.get_item(i)["key"] for i in range(4)]
    latent_set = LatentsDataset(local=str(latents), resolution=SIDE, batch_size=1, shuffle=False)
    assert [latent_set.get_item(i)["key"] for i in range(4)] == image_keys
    samples = [latent_set[i] for i in range(4)]
    latent_batch = {k: torch.stack([torch.as_tensor(s[k]) for s in samples]) for k in samples[0]}
    expected = torch.tensor([by_key[key] for key in image_keys])
    for batch in (image_batch, latent_batch):
        assert torch.equal(batch["eval_timestep"], expected)
        _, _, level = model.eval_forward(batch)
        assert torch.equal(level, expected.float() / 8)


def test_the_cc12m_set_reads_the_256_px_png_not_the_original_and_a_rerun_continues(tmp_path):
    rows = write_cc12m_disk(tmp_path / "cc12m_disk", files=2, per_file=3, no_png=4)
    argv = ["mlperf-flux-images", "--src", tmp_path / "cc12m_disk", "--out", tmp_path / "out"]
    assert run_cli(*argv) == 0
    written = _rows(tmp_path / "out")
    assert sorted(written) == [row["__key__"] for row in rows if row["png"] is not None]
    for row in rows:
        if row["png"] is not None:
            assert written[row["__key__"]]["image"] == row["png"]["bytes"]
            assert written[row["__key__"]]["caption"] == row["txt"]
            assert "eval_timestep" not in written[row["__key__"]]
    report = json.loads((tmp_path / "out" / "convert-report.json").read_text())
    assert report["samples_skipped"] == {"missing_image": 1}
    assert run_cli(*argv) == 0  # both inputs done: nothing converted again
    report = json.loads((tmp_path / "out" / "convert-report.json").read_text())
    assert report["inputs_done_this_run"] == 0 and report["samples_written"] == 5


def test_each_wrong_set_is_one_line_naming_the_command_that_reads_it(tmp_path, capsys):
    write_reference_set(tmp_path / "coco_preprocessed", files=1, per_file=2, timesteps=True)
    write_coco_webdataset(tmp_path / "coco", samples=2, per_shard=2)
    write_cc12m_disk(tmp_path / "cc12m_disk", files=1, per_file=2)
    (tmp_path / "empty").mkdir()
    cases = [
        (
            "mlperf-flux-images",
            "coco_preprocessed",
            "not its image set: `sd-convert mlperf-flux` converts it",
        ),
        ("mlperf-flux-images", "empty", "neither the reference's CC12M image set (data-*.arrow"),
        ("mlperf-flux", "coco", "`sd-convert mlperf-flux-images` converts it"),
        ("mlperf-flux", "cc12m_disk", "`sd-convert mlperf-flux-images` converts it"),
    ]
    for source, src, message in cases:
        assert run_cli(source, "--src", tmp_path / src, "--out", tmp_path / f"out-{src}") == 1
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1, err
        assert not (tmp_path / f"out-{src}").exists()


def test_the_coco_set_converted_to_the_bucket_reads_back_with_its_timesteps(s3_server, tmp_path, monkeypatch):  # noqa: F811
    from data.image_caption import ImageCaptionDataset
    from models.engine.tokenizer import build_tokenizer

    for name, value in s3_server.env().items():
        monkeypatch.setenv(name, value)
    rows = write_coco_webdataset(tmp_path / "coco", samples=5, per_shard=3)
    out = f"s3://{BUCKET}/mlperf/coco-images"
    assert (
        run_cli("mlperf-flux-images", "--src", tmp_path / "coco", "--out", out, "--work-dir", tmp_path / "w")
        == 0
    )
    dataset = ImageCaptionDataset(tokenizer=build_tokenizer(), resolution=SIDE, remote=out,
                                  local=str(tmp_path / "cache"), shuffle=False, batch_size=1)  # fmt: skip
    assert [dataset.get_item(i)["key"] for i in range(5)] == [row["key"] for row in rows]
    assert [dataset[i]["eval_timestep"] for i in range(5)] == [row["timestep"] for row in rows]
    assert dataset.get_item(4)["image"] == rows[4]["png"]
