"""`sd2-narrow`: sd2-base's UNet at small widths, for CPU measurements of what does not depend on
width (host time per step, op counts, graph breaks, recompiles, compiled-against-eager losses).

The UNet has sd2-base's blocks (4 levels, 2 ResNet + 2 transformer blocks a level, linear
projections, SDPA, the same op count) at widths 32/64/128/128 on 8x8 latents; the VAE and text
encoder are the tiny preset's, unused when batches are precomputed latents (8 channels: the VAE's
mean and logvar) and 77x32 text embeddings. Shared by `bench/overhead.py host` and the tests (tests
may import bench; library code does not).
"""

PRESET = "sd2-narrow"


def register_preset() -> str:
    """Adds the preset to models.PRESETS and models.MODELS (idempotent) and returns its name."""
    from models import MODELS, PRESETS, build_model

    unet = dict(
        PRESETS["sd2-base"]["unet"],
        sample_size=8,
        block_out_channels=(32, 64, 128, 128),
        attention_head_dim=(1, 2, 4, 4),  # sd2's head width (64) is out of reach at these widths
        cross_attention_dim=PRESETS["tiny"]["unet"]["cross_attention_dim"],
    )
    PRESETS[PRESET] = dict(PRESETS["tiny"], unet=unet)
    MODELS[PRESET] = build_model
    return PRESET
