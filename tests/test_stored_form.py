"""models/stored_form.py: a preset's stored form (what `sd-convert latents` stores of a caption) shaped
by its family's conditioner on meta-device encoders, for every family; what reads it: the random
latents of the GPU check and benchmarks (recipes/prepare.py) and the frozen encoders' FLOPs
(models/flops.py)."""

import pytest
import torch

import models.registry as families
from convert.encoders import load_encoders
from convert.latents import _text_columns
from data.latent_dataset import LatentsDataset
from data.loader import collate
from models import build_model, flops
from models.flop_count import _BATCH, _count
from models.stored_form import meta_ids, meta_parts, stored_shapes
from recipes.prepare import prepare_random_latents


@pytest.mark.parametrize(
    ("preset", "t5", "expected"),
    [
        ("sd2-base", False, {"text_embeds": (77, 1024)}),
        ("sdxl-base", False, {"text_embeds": (77, 2048), "pooled_text_embeds": (1280,)}),
        ("sd3-medium", False, {"text_embeds": (77, 2048), "pooled_text_embeds": (2048,)}),
        (
            "sd3-medium",
            True,
            {"text_embeds": (77, 2048), "pooled_text_embeds": (2048,), "text_embeds_3": (77, 4096)},
        ),
        ("flux-schnell", False, {"text_embeds": (256, 4096), "pooled_text_embeds": (768,)}),  # T5 + CLIP
        ("flux-dev", False, {"text_embeds": (512, 4096), "pooled_text_embeds": (768,)}),
    ],
)
@pytest.mark.heavy
def test_the_full_presets_stored_form(preset, t5, expected):
    assert stored_shapes(preset, t5) == expected


TINY = [
    ("tiny", False),
    ("sdxl-tiny", False),
    ("mmdit-tiny", False),
    ("mmdit-tiny-t5", True),
    ("flux-tiny", False),
]


@pytest.mark.parametrize(("preset", "t5"), TINY)
@pytest.mark.heavy
def test_random_latents_are_what_convert_stores_and_the_model_trains_on(tmp_path, preset, t5):
    """For a tiny preset of every family: the random set's text columns have the shapes the real
    encoders' stored form has (convert.latents' own call), and the preset's model trains on a batch."""
    local = prepare_random_latents(tmp_path / "latents", preset, n=2, resolutions=(32,), t5=t5)
    dataset = LatentsDataset(local=str(local), resolution=32, batch_size=1, shuffle=False)
    samples = [dataset[0], dataset[1]]
    real = _text_columns(load_encoders(preset, t5=t5), ["a red square"], "cpu")
    text = {k: v for k, v in samples[0].items() if k in real}
    assert {k: tuple(v.shape) for k, v in text.items()} == {k: v.shape[1:] for k, v in real.items()}
    batch = collate(samples)  # as the data loader batches them
    model = build_model(preset)
    loss = model.loss(model(batch), batch)
    assert torch.isfinite(loss)


def test_flux_schnell_random_latents_hold_t5_s_context_and_clip_s_pooled_vector(tmp_path):
    """What made recipes/prepare.py fail for Flux (it read CLIP widths and an SD3 T5): MLPerf's shapes."""
    local = prepare_random_latents(tmp_path / "flux", "flux-schnell", n=1, resolutions=(256,))
    sample = LatentsDataset(local=str(local), resolution=256, batch_size=1)[0]
    assert sample["latents"].shape == (32, 32, 32)  # 16 channels' mean and log-variance
    assert sample["text_embeds"].shape == (256, 4096) and sample["pooled_text_embeds"].shape == (768,)


@pytest.mark.heavy
def test_frozen_flops_run_t5_at_the_presets_length():
    """The frozen forwards are the VAE encoder and the conditioner's encoders, each at the length it
    reads: flux-tiny's CLIP at 77 tokens, its T5 at the preset's 8 (not 77); flux-dev's 512 T5 tokens
    cost more than schnell's 256."""
    parts = meta_parts("flux-tiny")
    with torch.device("meta"):
        images = torch.randn(_BATCH, 3, 32, 32)
        clip, t5 = (torch.zeros(_BATCH, n, dtype=torch.long) for n in (77, 8))
    with torch.no_grad():
        vae = _count(lambda: parts.vae.encode(images).latent_dist.sample())
        counted = [_count(lambda: parts.text_encoder(clip)), _count(lambda: parts.text_encoder_2(t5))]
    assert flops.frozen_flops_per_image("flux-tiny", 32) == (vae + sum(counted)) / _BATCH
    assert meta_ids(parts, families.of("flux-tiny").conditioner)["input_ids_3"].shape == (1, 8)
    assert flops.frozen_flops_per_image("flux-dev", 256) > flops.frozen_flops_per_image("flux-schnell", 256)
