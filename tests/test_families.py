"""Every model family against the same checks (issue 38).

First, the bits: tests/golden/family-bits.json holds what each tiny preset gives today (training
losses, every exported tensor, a generated image, `sd-convert latents` columns), recorded by
tests/golden/make_family_bits.py. A refactor of models/ must leave every one unchanged; when numerics
change on purpose, re-record with that script and say why in the commit.
"""

import json
from pathlib import Path

import pytest

from tests.golden.make_family_bits import GOLDEN, RECIPES, family_bits

PRESETS = list(RECIPES)


@pytest.fixture(scope="module")
def golden() -> dict:
    return json.loads(GOLDEN.read_text())["families"]


def _differences(name: str, got: dict, expected: dict) -> list[str]:
    missing, extra = sorted(expected.keys() - got.keys()), sorted(got.keys() - expected.keys())
    changed = sorted(k for k in expected.keys() & got.keys() if got[k] != expected[k])
    return [
        f"{name}: {what} {keys[:5]}{'...' if len(keys) > 5 else ''}"
        for what, keys in (("missing", missing), ("new", extra), ("changed", changed))
        if keys
    ]


@pytest.mark.fit
@pytest.mark.parametrize("preset", PRESETS)
def test_every_family_gives_the_recorded_bits(preset, golden, shapes_mds, tmp_path: Path):
    got, expected = family_bits(preset, shapes_mds, tmp_path), golden[preset]
    assert got["losses"] == expected["losses"]  # exact floats: the same noise, data and numerics
    problems = _differences("pipeline", got["pipeline"], expected["pipeline"])
    if got["image"] != expected["image"]:
        problems.append("generate: another image for the same seed")
    for i, (row, want) in enumerate(zip(got["latents"], expected["latents"], strict=True)):
        problems += _differences(f"sd-convert latents row {i}", row, want)
    assert not problems, "\n".join(problems)
