"""A ComposerModel that trains a preset's AutoencoderKL on its own: the autoencoder recipe.

Loss = mean squared reconstruction error + `kl_weight` x the posterior's KL to N(0, I) (kept small,
as in Stable Diffusion's VAE, so the latents stay informative). It also tracks the running variance
of the latents it samples; `save_pretrained` turns that into the VAE's `scaling_factor` (1 / std,
how SD's 0.18215 was chosen), so a diffusion model trained on these latents sees unit variance.
The saved folder is diffusers-format: `model.pretrained: FOLDER` with `pretrained_components: [vae]`
makes it the frozen VAE of a StableDiffusion preset.
"""

import logging
from pathlib import Path

import torch
import torch.nn.functional as F
from composer.models import ComposerModel
from diffusers import AutoencoderKL
from torchmetrics import MeanSquaredError

from models.engine.pixels import to_float
from models.engine.tokenizer import build_tokenizer
from models.registry import PRESETS

log = logging.getLogger(__name__)

LATENT_VAR_MOMENTUM = 0.99  # running variance over roughly the last 100 batches


class Autoencoder(ComposerModel):
    def __init__(self, vae: AutoencoderKL, kl_weight: float = 1e-6):
        super().__init__()
        if kl_weight < 0:
            raise ValueError(f"kl_weight must be >= 0, not {kl_weight}")
        self.vae = vae
        self.kl_weight = kl_weight
        # The dataloader builder tokenizes captions for every image-caption batch; unused here.
        self.tokenizer = build_tokenizer()
        self.register_buffer("latent_var", torch.tensor(1.0))
        self.val_mse = MeanSquaredError()

    def forward(self, batch):
        posterior = self.vae.encode(to_float(batch["image"])).latent_dist
        latents = posterior.sample()
        if self.training:
            with torch.no_grad():
                self.latent_var.lerp_(latents.float().var(), 1 - LATENT_VAR_MOMENTUM)
        return self.vae.decode(latents).sample, posterior

    def loss(self, outputs, batch):
        reconstruction, posterior = outputs
        mse = F.mse_loss(reconstruction.float(), to_float(batch["image"]).float())
        return mse + self.kl_weight * posterior.kl().mean()

    def eval_forward(self, batch, outputs=None):
        if outputs is not None:
            return outputs[0]
        return self.vae.decode(self.vae.encode(to_float(batch["image"])).latent_dist.mode()).sample

    def get_metrics(self, is_train: bool = False):
        return {} if is_train else {"MeanSquaredError": self.val_mse}

    def update_metric(self, batch, outputs, metric) -> None:
        metric.update(outputs, to_float(batch["image"]))

    @torch.no_grad()
    def reconstruct(self, images: torch.Tensor) -> torch.Tensor:
        """Images in [-1, 1] through the posterior's mean and back, in [-1, 1]."""
        return self.vae.decode(self.vae.encode(images).latent_dist.mode()).sample.clamp(-1, 1)

    def save_pretrained(self, folder: str | Path) -> Path:
        """Write `folder/vae/` (diffusers format) with scaling_factor = 1 / std of the latents."""
        scale = float(self.latent_var.clamp_min(1e-12).rsqrt())
        self.vae.register_to_config(scaling_factor=scale)
        self.vae.save_pretrained(Path(folder) / "vae", safe_serialization=True)
        log.info("wrote the VAE (scaling_factor %.4f) to %s", scale, Path(folder) / "vae")
        return Path(folder)


def build_autoencoder(preset: str, *, kl_weight: float = 1e-6) -> Autoencoder:
    """The Autoencoder for the VAE of `preset` ("tiny" or "tiny-vae": a name in models.registry.PRESETS,
    with or without the "-vae" suffix run configs use), with random weights."""
    name = preset.removesuffix("-vae")
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {preset!r}; choose one of {sorted(PRESETS)}")
    model = Autoencoder(AutoencoderKL(**PRESETS[name]["vae"]), kl_weight=kl_weight)
    model.preset = f"{name}-vae"  # for the checkpoint's model record (models/checkpoints/record.py)
    return model
