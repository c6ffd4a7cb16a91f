"""`sd-convert latents --precision`: a flux preset's encoders run in bf16 by default, as the MLPerf Flux.1
reference's preprocessing runs them; other presets in fp32, with the digest of outputs written before
the option. The difference bf16 makes, measured on flux-tiny's random encoders over the shapes."""

import json

import pytest
import torch

from convert.latents import LatentsOptions, convert_latents, default_precision, preset_columns
from data.latent_dataset import LatentsDataset

RESOLUTION = 32


def _stored(shapes_mds, out, tmp_path, **kwargs) -> dict[str, torch.Tensor]:
    convert_latents(
        str(shapes_mds / "mds"), str(out), [RESOLUTION], preset="flux-tiny", batch_size=32,
        work_dir=tmp_path / "work", progress=False, **kwargs,
    )  # fmt: skip
    dataset = LatentsDataset(local=str(out), resolution=RESOLUTION, batch_size=1, shuffle=False)
    samples = [dataset[i] for i in range(len(dataset))]
    return {k: torch.stack([s[k] for s in samples]) for k in ("latents", "text_embeds", "pooled_text_embeds")}


def _bf16_exact(x: torch.Tensor) -> bool:
    return torch.equal(x.to(torch.bfloat16).float(), x)


@pytest.mark.heavy
def test_flux_encodes_in_bf16_by_default_within_two_percent_of_fp32(shapes_mds, tmp_path):
    assert default_precision("flux-schnell") == default_precision("flux-tiny") == "bf16"
    assert default_precision("sd2-base") == default_precision("mmdit-tiny") == "fp32"
    bf16 = _stored(shapes_mds, tmp_path / "bf16", tmp_path)
    fp32 = _stored(shapes_mds, tmp_path / "fp32", tmp_path, precision="fp32")
    # An output converted before --precision existed (its record has no precision; fp32 keeps the old
    # digest): a rerun with the flux default continues it in fp32 instead of refusing it.
    record = json.loads((tmp_path / "fp32" / "sd-convert.json").read_text())
    del record["options"]["precision"]
    (tmp_path / "fp32" / "sd-convert.json").write_text(json.dumps(record))
    assert _stored(shapes_mds, tmp_path / "fp32", tmp_path).keys() == fp32.keys()
    report = json.loads((tmp_path / "fp32" / "convert-report.json").read_text())
    assert report["inputs_done_this_run"] == 0 and report["inputs_done"] > 0
    for name in bf16:
        assert _bf16_exact(bf16[name]) and not _bf16_exact(fp32[name]), name
        relative = ((bf16[name] - fp32[name]).norm() / fp32[name].norm()).item()
        assert 0 < relative < 0.02, (name, relative)  # 0.66-0.93% measured 2026-11-29: docs/data.md


def test_fp32_keeps_the_digest_of_outputs_written_before_the_option():
    columns = preset_columns("tiny", [RESOLUTION])
    before = LatentsOptions((RESOLUTION,), "tiny", None, ())
    assert LatentsOptions((RESOLUTION,), "tiny", None, (), precision="fp32").digest(columns) == before.digest(
        columns
    )
    assert LatentsOptions((RESOLUTION,), "tiny", None, (), precision="bf16").digest(columns) != before.digest(
        columns
    )
    with pytest.raises(ValueError, match="--precision fp16: choose one of"):
        convert_latents("unused", "unused", [RESOLUTION], preset="tiny", precision="fp16")
