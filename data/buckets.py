"""Aspect-ratio buckets: the (height, width) each bucket of `sd-convert --buckets` trains at.

The converter writes one sub-dataset per aspect ratio, `<out>/ar{w/h}/...` (convert/samples.py's
`bucket_label`). Training resizes each bucket's images to cover a (height, width) with about the
recipe's pixel count (`resolution`^2) and that aspect ratio, both multiples of what the model can
take (the VAE's downsampling times the UNet's: 64 for SD2, 8 for the tiny preset), then center-crops:
no square crops, no padding. At 256 px: ar1 -> 256x256, ar0.75 -> 320x192, ar1.33333 -> 192x320.
`sd-convert latents` uses the same sizes, so precomputed latents see the same pixels.
"""

import math
import re

from data.image_caption import bucket_crop, cover_crop  # noqa: F401 - the bucket transform lives with the square one

_LABEL = re.compile(r"^ar(\d+(?:\.\d+)?)$")


def bucket_ratio(label: str) -> float | None:
    """ar0.75 -> 0.75 (width / height); None for a name that is not a bucket."""
    match = _LABEL.match(label)
    return float(match.group(1)) if match else None


def size_multiple(vae_block_out_channels, unet_block_out_channels) -> int:
    """Pixels per latent times latents per UNet bottleneck cell: image sizes must be multiples."""
    return 2 ** (len(vae_block_out_channels) - 1) * 2 ** (len(unet_block_out_channels) - 1)


def bucket_size(ratio: float, resolution: int, multiple: int = 64) -> tuple[int, int]:
    """(height, width) for width/height `ratio`, about resolution^2 pixels, multiples of `multiple`."""
    if ratio <= 0:
        raise ValueError(f"aspect ratio must be positive, got {ratio}")
    height, width = resolution / math.sqrt(ratio), resolution * math.sqrt(ratio)
    return (
        max(multiple, round(height / multiple) * multiple),
        max(multiple, round(width / multiple) * multiple),
    )


def check_size(name: str, size, multiple: int) -> tuple[int, int]:
    """A configured (height, width), each a positive multiple of `multiple`, or an error naming `name`."""
    if not (isinstance(size, (list, tuple)) and len(size) == 2 and all(isinstance(v, int) for v in size)):
        raise ValueError(f"{name}: give [height, width] in pixels, got {size!r}")
    if any(v < multiple or v % multiple for v in size):
        nearest = bucket_size(size[1] / size[0], int(math.sqrt(size[0] * size[1])), multiple)
        raise ValueError(
            f"{name}={list(size)}: each side must be a multiple of {multiple} (the VAE's downsampling times "
            f"the UNet's), e.g. {list(nearest)}"
        )
    return tuple(size)
