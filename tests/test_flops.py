"""models.flops: FlopCounterMode on meta-device models reproduces the measured SD2 base numbers."""

import pytest

from models import flops


@pytest.mark.parametrize("resolution, reference", [(256, 0.539e12), (512, 2.409e12)])
def test_sd2_base_unet_training_flops(resolution, reference):
    assert flops.training_flops_per_image("sd2-base", resolution) == pytest.approx(reference, rel=0.02)


def test_tiny_is_positive_and_smaller():
    tiny = flops.training_flops_per_image("tiny", 32)
    assert 0 < tiny < flops.training_flops_per_image("tiny", 64)
    assert flops.training_flops_per_image("tiny", 256) < flops.training_flops_per_image("sd2-base", 256)


def test_frozen_forwards_are_counted_separately():
    frozen = flops.frozen_flops_per_image("sd2-base", 256)
    assert 0 < frozen < flops.training_flops_per_image("sd2-base", 256)


def test_mfu():
    assert flops.mfu(100, 2e12, 1e15) == pytest.approx(0.2)
    with pytest.raises(ValueError, match="peak_flops"):
        flops.mfu(100, 2e12, 0)


@pytest.mark.parametrize("resolution", [0, 100, 260])
def test_resolution_must_fit_the_model(resolution):
    with pytest.raises(ValueError, match="positive multiple of 64"):
        flops.training_flops_per_image("sd2-base", resolution)


def test_cli(capsys):
    flops.main(["--preset", "tiny", "--resolution", "32", "--images-per-sec", "10", "--peak-tflops", "1"])
    out = capsys.readouterr().out
    assert out.startswith("tiny 32 px: UNet fwd+bwd") and "MFU" in out
    with pytest.raises(SystemExit):
        flops.main(["--preset", "tiny", "--resolution", "30"])
