"""`sd-convert mlperf-flux` (convert/mlperf_flux.py): the MLPerf Flux.1 reference's preprocessed sets,
written here in the reference's format (datasets' save_to_disk: Arrow IPC stream files of __key__,
np.save'd bf16-as-uint16 t5_encodings, clip_encodings, mean, logvar, and an int32 timestep; the
empty encodings as fp16 .npy), at flux-tiny's shapes. Converted, the set is what the latents source
writes (values exact, bf16 -> fp16), validation uses each sample's stored timestep, and bad rows and
bad files are refused as they should be."""

import io
import json
import logging

import numpy as np
import pyarrow as pa
import pytest
import torch

from data.latent_dataset import EMPTY_CAPTION, LatentsDataset, load_empty_caption
from tests.convert_fixtures import run_cli
from tests.s3_server import BUCKET, s3_server  # noqa: F401  (s3_server is a fixture)

PRESET, RESOLUTION, SIDE = "flux-tiny", 32, 8  # flux-tiny: a 4-channel VAE of factor 4
SCHEMA = pa.schema(
    [
        ("__key__", pa.string()),
        ("t5_encodings", pa.binary()),
        ("clip_encodings", pa.binary()),
        ("mean", pa.binary()),
        ("logvar", pa.binary()),
        ("timestep", pa.int32()),
    ]
)


def _bf16_bytes(value: torch.Tensor) -> bytes:
    """preprocess_flux_dataset.py serialize_numpy_array: bf16 viewed as uint16, np.save'd."""
    buffer = io.BytesIO()
    np.save(buffer, value.to(torch.bfloat16).view(torch.uint16).numpy())
    return buffer.getvalue()


def _rows(n: int, start: int, timesteps: bool, generator) -> list[dict]:
    rows = []
    for i in range(start, start + n):
        rows.append(
            {
                "__key__": f"{i:06d}",
                "t5_encodings": torch.randn(8, 64, generator=generator) * 3,
                "clip_encodings": torch.randn(32, generator=generator),
                "mean": torch.randn(4, SIDE, SIDE, generator=generator),
                "logvar": torch.rand(4, SIDE, SIDE, generator=generator) * -4,
                "timestep": i % 8 if timesteps else None,
            }
        )
    return rows


def write_reference_set(folder, files: int, per_file: int, timesteps: bool, huge_row: int | None = None):
    """`files` Arrow stream files named as save_to_disk names them; returns the rows' tensors."""
    folder.mkdir(parents=True)
    generator = torch.Generator().manual_seed(0)
    everything = []
    for f in range(files):
        rows = _rows(per_file, f * per_file, timesteps, generator)
        everything += rows
        table = pa.Table.from_pylist(
            [
                {k: _bf16_bytes(v) if isinstance(v, torch.Tensor) else v for k, v in row.items()}
                for row in rows
            ],
            schema=SCHEMA,
        )
        if huge_row is not None and f == 0:  # a T5 value beyond fp16's range
            big = everything[huge_row]["t5_encodings"].clone()
            big[0, 0] = 1e6
            column = table.column("t5_encodings").to_pylist()
            column[huge_row] = _bf16_bytes(big)
            table = table.set_column(1, "t5_encodings", pa.array(column, pa.binary()))
        with pa.OSFile(str(folder / f"data-{f:05d}-of-{files:05d}.arrow"), "wb") as sink:
            with pa.ipc.new_stream(sink, SCHEMA) as writer:
                writer.write_table(table, max_chunksize=3)
    (folder / "dataset_info.json").write_text("{}")
    return everything


def write_empty_encodings(folder):
    folder.mkdir(parents=True)
    np.save(folder / "t5_empty.npy", np.full((1, 8, 64), 0.25, dtype=np.float16))
    np.save(folder / "clip_empty.npy", np.full((1, 32), -0.5, dtype=np.float16))


@pytest.fixture(scope="module")
def coco(tmp_path_factory):
    """The validation-like set (timesteps stored) converted; (output, the rows written)."""
    root = tmp_path_factory.mktemp("mlperf")
    rows = write_reference_set(root / "coco_preprocessed", files=2, per_file=8, timesteps=True, huge_row=2)
    write_empty_encodings(root / "empty")
    out = root / "coco-flux"
    argv = ["mlperf-flux", "--src", root / "coco_preprocessed", "--out", out, "--preset", PRESET]
    assert run_cli(*argv, "--empty-encodings", root / "empty") == 0
    return out, rows


def test_the_converted_set_holds_the_reference_values_exactly_and_skips_what_fp16_cannot_hold(coco):
    out, rows = coco
    report = json.loads((out / "convert-report.json").read_text())
    assert report["samples_written"] == 15 and report["samples_skipped"] == {"out_of_fp16_range": 1}
    index = json.loads((out / "index.json").read_text())
    assert sum(shard["samples"] for shard in index["shards"]) == 15
    dataset = LatentsDataset(local=str(out), resolution=RESOLUTION, batch_size=1, shuffle=False)
    kept = [row for i, row in enumerate(rows) if i != 2]
    assert len(dataset) == 15
    for i, row in enumerate(kept):
        sample = dataset[i]
        bf16 = {k: v.to(torch.bfloat16).float() for k, v in row.items() if isinstance(v, torch.Tensor)}
        assert torch.equal(sample["latents"], torch.cat([bf16["mean"], bf16["logvar"]]))
        assert torch.equal(sample["text_embeds"], bf16["t5_encodings"])
        assert torch.equal(sample["pooled_text_embeds"], bf16["clip_encodings"])
        assert sample["eval_timestep"] == row["timestep"]
    tensors, metadata = load_empty_caption((out / EMPTY_CAPTION).read_bytes())
    assert torch.equal(tensors["text_embeds"], torch.full((1, 8, 64), 0.25))
    assert torch.equal(tensors["pooled_text_embeds"], torch.full((1, 32), -0.5)) and metadata["caption"] == ""


@pytest.mark.heavy
def test_validation_puts_each_sample_at_its_stored_timestep(coco, caplog):
    """flux-tiny with model.eval_timesteps=8 on the converted set: sample i is validated at t = i / 8
    for the i the set stores (not at its content hash's), in every batch; another K is refused."""
    from models import build_model

    out, rows = coco
    dataset = LatentsDataset(local=str(out), resolution=RESOLUTION, batch_size=1, shuffle=False)
    samples = [dataset[i] for i in range(6)]
    batch = {k: torch.stack([torch.as_tensor(s[k]) for s in samples]) for k in samples[0]}
    model = build_model(PRESET, eval_timesteps=8)
    _, _, level = model.eval_forward(batch)
    assert torch.equal(level, batch["eval_timestep"].float() / 8)
    assert not torch.equal(level, model.eval_levels[[s % 8 for s in model.eval_seeds(batch)]])
    for k in (4, 16):  # i / 8 is not one of i / k's levels: refused, never reinterpreted
        with pytest.raises(ValueError, match=f"set model.eval_timesteps=8, not {k}"):
            build_model(PRESET, eval_timesteps=k).eval_forward(batch)
    unset = build_model(PRESET)
    with caplog.at_level(logging.WARNING, logger="models.engine.latent_diffusion"):
        unset.eval_forward(batch)
        unset.eval_forward(batch)
    assert [r.getMessage() for r in caplog.records].count(
        "the validation set stores a fixed timestep per sample (MLPerf's), which model.eval_timesteps "
        "unset ignores: set model.eval_timesteps=8 to use them"
    ) == 1


def test_a_training_set_has_no_timestep_column_and_a_rerun_continues_or_adds_the_empty_caption(tmp_path):
    write_reference_set(tmp_path / "cc12m", files=2, per_file=5, timesteps=False)
    argv = ["mlperf-flux", "--src", tmp_path / "cc12m", "--out", tmp_path / "out", "--preset", PRESET]
    assert run_cli(*argv) == 0
    index = json.loads((tmp_path / "out" / "index.json").read_text())
    assert all("eval_timestep" not in shard["column_names"] for shard in index["shards"])
    assert "latents_32" in index["shards"][0]["column_names"]
    assert run_cli(*argv) == 0  # both inputs done: nothing converted again
    report = json.loads((tmp_path / "out" / "convert-report.json").read_text())
    assert report["samples_written"] == 10 and report["inputs_done_this_run"] == 0
    assert not (tmp_path / "out" / EMPTY_CAPTION).exists()
    write_empty_encodings(tmp_path / "empty")  # given only now: added without converting again
    assert run_cli(*argv, "--empty-encodings", tmp_path / "empty") == 0
    assert load_empty_caption((tmp_path / "out" / EMPTY_CAPTION).read_bytes())[0]["text_embeds"].shape == (
        1,
        8,
        64,
    )


def test_a_folder_that_is_not_the_reference_format_is_one_line(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    assert (
        run_cli("mlperf-flux", "--src", tmp_path / "empty", "--out", tmp_path / "o", "--preset", PRESET) == 1
    )
    assert "no data-*.arrow files" in capsys.readouterr().err
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "data-00000-of-00001.arrow").write_bytes(b"not arrow at all")
    assert (
        run_cli("mlperf-flux", "--src", tmp_path / "bad", "--out", tmp_path / "o2", "--preset", PRESET) == 1
    )
    assert "not an Arrow IPC stream file" in capsys.readouterr().err
    write_reference_set(tmp_path / "schnell", files=1, per_file=2, timesteps=False)
    schnell = [
        "mlperf-flux",
        "--src",
        tmp_path / "schnell",
        "--out",
        tmp_path / "o3",
    ]  # --preset flux-schnell
    assert run_cli(*schnell) == 1
    assert (
        "mean is (4, 8, 8) per sample; preset flux-schnell reads (16, side, side)" in capsys.readouterr().err
    )
    assert not (tmp_path / "o").exists() and not (tmp_path / "o3" / "index.json").exists()


def test_a_set_converted_to_the_bucket_reads_back_from_an_empty_cache(s3_server, tmp_path, monkeypatch):  # noqa: F811
    from data.latent_dataset import read_set_file

    for name, value in s3_server.env().items():
        monkeypatch.setenv(name, value)
    rows = write_reference_set(tmp_path / "coco", files=2, per_file=3, timesteps=True)
    write_empty_encodings(tmp_path / "empty")
    out = f"s3://{BUCKET}/mlperf/coco-flux"
    argv = [
        "mlperf-flux",
        "--src",
        tmp_path / "coco",
        "--out",
        out,
        "--preset",
        PRESET,
        "--work-dir",
        tmp_path / "w",
    ]
    assert run_cli(*argv, "--empty-encodings", tmp_path / "empty") == 0
    dataset = LatentsDataset(
        remote=out, local=str(tmp_path / "cache"), resolution=RESOLUTION, batch_size=1, shuffle=False
    )
    assert [dataset[i]["eval_timestep"] for i in range(len(dataset))] == [row["timestep"] for row in rows]
    last = rows[-1]["mean"].to(torch.bfloat16).float()
    assert torch.equal(dataset[len(rows) - 1]["latents"][:4], last)
    tensors, _ = load_empty_caption(read_set_file(out, str(tmp_path / "cache2"), EMPTY_CAPTION, 60))
    assert torch.equal(tensors["pooled_text_embeds"], torch.full((1, 32), -0.5))
