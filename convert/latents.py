"""`latents` source: run the frozen VAE and text encoder over an MDS image-caption set once.

Writes, per sample, `latents_{R}` for each resolution R (the VAE posterior's mean and logvar,
unscaled, fp16: the model samples and scales them) and `text_embeds` (fp16), plus caption and key.
Training on these skips the VAE and text encoder, about 1.4x faster for SD2 (mosaicml/diffusion).
"""

import io
import logging
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from streaming import StreamingDataset

from data.image_caption import image_transform
from data.latents import latents_column
from models.tokenizer import tokenize

log = logging.getLogger(__name__)


def columns(resolutions: list[int]) -> dict[str, str]:
    cols = {"caption": "str", "key": "str", "text_embeds": "ndarray:float16"}
    cols.update({latents_column(r): "ndarray:float16" for r in resolutions})
    return cols


def _pixels(image_bytes: bytes, resolution: int) -> torch.Tensor:
    return image_transform(resolution)(Image.open(io.BytesIO(image_bytes)).convert("RGB"))


@torch.no_grad()
def iter_samples(
    src: str, model, resolutions: list[int], batch_size: int = 16, device: str = "cpu"
) -> Iterator[dict]:
    """Samples of `src` (an MDS folder with `image` and `caption`) with their latents, in order.

    Only the VAE and text encoder are used (and must already be on `device`)."""
    dataset = StreamingDataset(local=src, shuffle=False, batch_size=batch_size)
    for start in range(0, len(dataset), batch_size):
        rows = [dataset[i] for i in range(start, min(start + batch_size, len(dataset)))]
        captions = [row["caption"] for row in rows]
        text = model.encode_text(tokenize(model.tokenizer, captions).to(device)).half().cpu().numpy()
        latents = {}
        for r in resolutions:
            pixels = torch.stack([_pixels(row["image"], r) for row in rows]).to(device)
            latents[r] = model.vae_moments(pixels).half().cpu().numpy()
        for j, row in enumerate(rows):
            sample = {"caption": captions[j], "key": str(row.get("key", start + j)), "text_embeds": text[j]}
            sample.update({latents_column(r): np.ascontiguousarray(latents[r][j]) for r in resolutions})
            yield sample


def convert_latents(
    src: str,
    out: str,
    resolutions: list[int],
    preset: str = "sd2-base",
    pretrained: str | None = None,
    batch_size: int = 16,
    device: str | None = None,
) -> dict:
    """Encode the MDS image-caption set at `src` with `preset`'s frozen VAE and text encoder (loaded
    from `pretrained`, a diffusers folder or hub id; random weights without it, for tests) into `out`."""
    from convert.common import ConvertError
    from convert.mds import write_mds
    from models import build_model

    if not (Path(src) / "index.json").is_file():
        raise ConvertError(f"--src {src}: no index.json, not an MDS dataset (convert the images first)")
    components = ("vae", "text_encoder", "tokenizer") if pretrained else ()
    model = build_model(preset, pretrained=pretrained, pretrained_components=components)
    if not pretrained:
        log.warning("no --pretrained: encoding with the %s preset's random weights", preset)
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    model.vae.to(device).eval()
    model.text_encoder.to(device).eval()
    samples = iter_samples(src, model, resolutions, batch_size, device=device)
    return write_mds(samples, out, columns(resolutions))
