"""The networks that judge generated images: Inception features for FID/KID, CLIP for CLIP score.

Real ones (the default) read their weights from local files only; nothing downloads at run time:
  - Inception: torch-fidelity's TF-ported InceptionV3 (the network of the original FID code), 2048
    pool features, through torchmetrics' `NoTrainInceptionV3`.
  - CLIP: an open_clip model; MLPerf's Stable Diffusion benchmark uses ViT-H-14 (LAION-2B weights).
`tiny` builds small randomly initialised stand-ins with the same interfaces (uint8 images in,
features out; captions in, embeddings out), seeded so they are the same every time. Their numbers
rank sets (a set against itself ~0, a different set larger) but are not comparable to published
FID or CLIP scores: they are for tests and the CPU demo.
"""

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

INCEPTION_FILE = "weights-inception-2015-12-05-6726825d.pth"
INCEPTION_URL = f"https://github.com/toshas/torch-fidelity/releases/download/v0.2.0/{INCEPTION_FILE}"
CLIP_ARCH = "ViT-H-14"  # MLPerf Training's Stable Diffusion CLIP score model
CLIP_URL = "https://huggingface.co/laion/CLIP-ViT-H-14-laion2B-s32B-b79K (open_clip_pytorch_model.bin)"
# open_clip's (and OpenAI CLIP's) image normalisation.
CLIP_MEAN, CLIP_STD = (0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711)
TINY_SEED = 0


class MissingWeights(FileNotFoundError):
    """A real extractor's weights file is not there; the message is one line saying what to get."""


class TinyInception(nn.Module):
    """A few random strided convolutions over the image resized to 64 px, pooled to 64 features."""

    num_features = 64

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv2d(3, 32, 3, stride=2), nn.ReLU(),
            nn.Conv2d(32, 64, 3, stride=2), nn.ReLU(),
            nn.Conv2d(64, 64, 3), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
        )  # fmt: skip

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = F.interpolate(images.float(), size=(64, 64), mode="bilinear", antialias=True)
        return self.net((x - 128) / 128)


def check_weights(inception_weights: str | Path | None, clip_model: str | Path | None, arch: str = CLIP_ARCH):
    """The real extractors' weights are there (MissingWeights if not), checked without loading any."""
    _check_inception(inception_weights)
    _check_clip(clip_model, arch)


def _check_inception(weights: str | Path | None) -> None:
    if weights is None or not Path(weights).is_file():
        where = f"{weights} does not exist" if weights else "no --inception-weights given"
        raise MissingWeights(
            f"FID/KID need the Inception weights ({where}): download {INCEPTION_URL} "
            "and pass --inception-weights PATH (or --extractors tiny for a random stand-in)"
        )


def _check_clip(model: str | Path | None, arch: str) -> None:
    if model is None or not Path(model).exists():
        where = f"{model} does not exist" if model else "no --clip-model given"
        raise MissingWeights(
            f"CLIP score needs {arch} weights ({where}): download {CLIP_URL} "
            "and pass --clip-model PATH (or --extractors tiny for a random stand-in)"
        )


def inception(kind: str, weights: str | Path | None = None) -> nn.Module:
    """uint8 (N, 3, H, W) -> (N, D) float features, in eval mode on the CPU."""
    if kind == "tiny":
        torch.manual_seed(TINY_SEED)
        return TinyInception().eval().requires_grad_(False)
    _check_inception(weights)
    from torchmetrics.image.fid import NoTrainInceptionV3

    network = NoTrainInceptionV3("inception-v3-compat", ["2048"], str(weights))
    network.num_features = 2048
    return network


@dataclass
class Clip:
    """An open_clip model and its tokenizer; embeddings are unit vectors."""

    model: nn.Module
    tokenizer: object

    @torch.no_grad()
    def images(self, images: torch.Tensor) -> torch.Tensor:
        """uint8 (N, 3, H, W) -> (N, E): resized (bicubic, antialiased) and center-cropped to the
        model's input size, normalised like open_clip's own preprocessing."""
        device = next(self.model.parameters()).device
        size = self.model.visual.image_size
        size = size[0] if isinstance(size, tuple | list) else size
        x = images.to(device).float() / 255
        height, width = x.shape[-2:]
        scale = size / min(height, width)
        x = F.interpolate(
            x, size=(round(height * scale), round(width * scale)), mode="bicubic", antialias=True
        ).clamp(0, 1)
        top, left = (x.shape[-2] - size) // 2, (x.shape[-1] - size) // 2
        x = x[..., top : top + size, left : left + size]
        mean = torch.tensor(CLIP_MEAN, device=device).view(1, 3, 1, 1)
        std = torch.tensor(CLIP_STD, device=device).view(1, 3, 1, 1)
        return F.normalize(self.model.encode_image((x - mean) / std).float(), dim=-1)

    @torch.no_grad()
    def texts(self, captions: list[str]) -> torch.Tensor:
        device = next(self.model.parameters()).device
        return F.normalize(self.model.encode_text(self.tokenizer(captions).to(device)).float(), dim=-1)

    def scores(self, images: torch.Tensor, captions: list[str]) -> torch.Tensor:
        """Per image, the cosine similarity of its embedding and its caption's (MLPerf's CLIP score
        is the mean of these; torchmetrics' CLIPScore is 100x it, clipped at 0)."""
        return (self.images(images) * self.texts(captions)).sum(-1)


def clip(kind: str, model: str | Path | None = None, arch: str = CLIP_ARCH) -> Clip:
    """`model`: an open_clip weights file for `arch`, or an open_clip folder (open_clip_config.json
    beside the weights, the layout of the hub's open_clip repositories)."""
    import open_clip

    if kind == "tiny":
        from open_clip.model import CLIP, CLIPTextCfg, CLIPVisionCfg

        torch.manual_seed(TINY_SEED)
        network = CLIP(
            embed_dim=32,
            vision_cfg=CLIPVisionCfg(layers=2, width=32, head_width=16, patch_size=8, image_size=32),
            text_cfg=CLIPTextCfg(context_length=77, vocab_size=49408, width=32, heads=2, layers=2),
        )
        return Clip(network.eval().requires_grad_(False), open_clip.get_tokenizer(CLIP_ARCH))
    _check_clip(model, arch)
    path = Path(model)
    if path.is_dir():
        name = f"local-dir:{path}"
        network = open_clip.create_model(name)
    else:
        name = arch
        network = open_clip.create_model(arch, pretrained=str(path))
    return Clip(network.eval().requires_grad_(False), open_clip.get_tokenizer(name))
