"""models.flops: the counter agrees with a closed-form count of the UNet's layers and with the
published SD2 base numbers, and counts every family's model on its own training path
(models/flop_count.py; the MMDiT's and Flux's closed forms: tests/test_mmdit.py, tests/test_flux.py)."""

import math

import pytest
import torch
from torch import nn

from compat.diffusers import Attention
from models import build_model, flops
from models.components import build_components
from models.presets import size_multiple
from models.registry import FAMILIES


@pytest.mark.heavy  # counts the FLOPs of the full-size SD2 UNet
@pytest.mark.parametrize("resolution, reference", [(256, 0.539e12), (512, 2.409e12)])
def test_sd2_base_unet_training_flops(resolution, reference):
    # The design docs' figures (torch FlopCounterMode on the diffusers SD2 base UNet, 77 x 1024 context).
    assert flops.training_flops_per_image("sd2-base", resolution) == pytest.approx(reference, rel=0.02)


def _closed_form_training_flops(preset: str, side: int, context_length: int = 77) -> tuple[int, set]:
    """UNet forward + backward FLOPs for ONE image with `side` x `side` latents, by formula.

    Per layer, with the shapes of a meta-device forward (hooks only read shapes; nothing is counted
    by torch): Conv2d 2*Cout*Cin*kh*kw*Hout*Wout, Linear 2*tokens*in*out, attention 2*Lq*Lk*inner
    for QK^T plus as much for AV. Backward: the weight gradient costs one forward more, the input
    gradient another one only where the input needs a gradient (not the latents, the timestep
    embedding or the text context); attention's four backward matmuls cost two forwards.
    Returns the count and the names of the layers whose input needs no gradient.
    """
    with torch.device("meta"):
        unet = build_components(preset)["unet"]
    total, no_input_grad = 0, set()

    def dense(name):
        def hook(module, args, out):
            nonlocal total
            x = args[0]
            if isinstance(module, nn.Conv2d):
                c_out, c_in, kh, kw = module.weight.shape
                forward = 2 * out.shape[0] * c_out * c_in * kh * kw * out.shape[2] * out.shape[3]
            else:
                forward = 2 * (x.numel() // x.shape[-1]) * module.in_features * module.out_features
            total += forward * (3 if x.requires_grad else 2)
            if not x.requires_grad:
                no_input_grad.add(name)

        return hook

    def attention(module, args, kwargs, out):
        nonlocal total
        x = args[0] if args else kwargs["hidden_states"]
        context = kwargs.get("encoder_hidden_states")
        queries = x.shape[1]
        keys = queries if context is None else context.shape[1]
        total += 3 * 2 * (2 * x.shape[0] * queries * keys * module.inner_dim)

    for name, module in unet.named_modules():
        if isinstance(module, (nn.Conv2d, nn.Linear)):
            module.register_forward_hook(dense(name))
        elif isinstance(module, Attention):
            module.register_forward_hook(attention, with_kwargs=True)
    config = unet.config
    with torch.device("meta"):
        unet(
            torch.randn(1, config.in_channels, side, side),
            torch.tensor([500]),
            encoder_hidden_states=torch.randn(1, context_length, config.cross_attention_dim),
        )
    return total, no_input_grad


# (preset, pixels, latent side): the tiny VAE downsamples 4x, SD2's 8x.
@pytest.mark.parametrize(
    "preset, resolution, side",
    [
        ("tiny", 32, 8),
        pytest.param("sd2-base", 256, 32, marks=pytest.mark.heavy),  # the full-size UNet
        pytest.param("sd2-base", 512, 64, marks=pytest.mark.heavy),
    ],
)
def test_training_flops_match_a_closed_form_count(preset, resolution, side):
    expected, no_input_grad = _closed_form_training_flops(preset, side)
    # Only the UNet's entry points skip the input gradient: the counted backward is the real one.
    assert {n.rsplit(".", 1)[-1] for n in no_input_grad} == {"conv_in", "linear_1", "to_k", "to_v"}
    assert all(
        n.endswith(("conv_in", "time_embedding.linear_1", "attn2.to_k", "attn2.to_v")) for n in no_input_grad
    )
    # Exact: the same layers, shapes and backward; a forward-only count would be about a third, a
    # wrong latent size or context length or a per-batch count would be off by a large factor.
    assert flops.training_flops_per_image(preset, resolution) == expected


@pytest.mark.heavy
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_family_is_counted_on_its_own_training_path(family):
    """No family has FLOP code: its tiny preset's model is counted through its own condition and
    denoiser call, the same from a live model's batch of captions (flops_per_batch: on a meta copy) as
    from the preset built on the meta device; the UNet's agrees with the closed form too."""
    preset = FAMILIES[family].tiny
    resolution = math.lcm(32, size_multiple(preset))
    per_image = flops.training_flops_per_image(preset, resolution)
    assert per_image > 0
    model = build_model(preset)
    captions = model.conditioner.ids(model, ["a red circle", "a small green square"])
    batch = {"image": torch.zeros(2, 3, resolution, resolution, dtype=torch.uint8), **captions}
    assert model.flops_per_batch(batch) == 2 * per_image
    if family == "sd":
        side = resolution // model.vae_scale_factor
        assert per_image == pytest.approx(_closed_form_training_flops(preset, side)[0], rel=0.01)


@pytest.mark.heavy
def test_tiny_is_positive_and_smaller():
    tiny = flops.training_flops_per_image("tiny", 32)
    assert 0 < tiny < flops.training_flops_per_image("tiny", 64)
    assert flops.training_flops_per_image("tiny", 256) < flops.training_flops_per_image("sd2-base", 256)


@pytest.mark.heavy
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
