"""The frozen networks that `sd-convert latents` (convert/latents.py) encodes with: a preset's VAE and
text encoders without its denoiser, making the model's own calls, so precomputed latents stay what
training on the images would compute. One class per family (SD1/SD2, SDXL, mmdit), built by
`load_encoders` from a diffusers folder or from the preset's seeded random weights.
"""

import json
from pathlib import Path

import torch

from models.mmdit import RectifiedFlowTransformer
from models.presets import PRESETS, family
from models.sdxl import StableDiffusionXL
from models.stable_diffusion import StableDiffusion


class Encoders:
    """The frozen VAE and text encoder without a UNet, making the model's own two calls (plain
    functions of `self.vae` / `self.text_encoder`), so precomputed latents stay what training on the
    images would compute."""

    vae_moments = StableDiffusion.vae_moments
    encode_text = StableDiffusion.encode_text
    micro_conditioning = False

    def __init__(self, vae, text_encoder, tokenizer):
        self.vae, self.text_encoder, self.tokenizer = vae, text_encoder, tokenizer

    def to(self, device) -> "Encoders":
        self.vae.to(device).eval()
        self.text_encoder.to(device).eval()
        return self


class SDXLEncoders(Encoders):
    """SDXL's: both text encoders, through StableDiffusionXL's own `encode_text` ((context, pooled))."""

    encode_text = StableDiffusionXL.encode_text
    micro_conditioning = True

    def __init__(self, vae, text_encoder, tokenizer, text_encoder_2, tokenizer_2):
        super().__init__(vae, text_encoder, tokenizer)
        self.text_encoder_2, self.tokenizer_2 = text_encoder_2, tokenizer_2

    def to(self, device) -> "SDXLEncoders":
        self.text_encoder_2.to(device).eval()
        return super().to(device)


class MMDiTEncoders(Encoders):
    """An mmdit preset's: both CLIPs through RectifiedFlowTransformer's own `encode_clip` ((context
    unpadded, pooled)) and, when given, T5 through its `tokenize_t5` and `encode_t5`."""

    encode_clip = RectifiedFlowTransformer.encode_clip
    encode_t5 = RectifiedFlowTransformer.encode_t5
    tokenize_t5 = RectifiedFlowTransformer.tokenize_t5

    def __init__(
        self,
        vae,
        text_encoder,
        tokenizer,
        text_encoder_2,
        tokenizer_2,
        *,
        t5_tokens: int,
        text_encoder_3=None,
        tokenizer_3=None,
    ):
        super().__init__(vae, text_encoder, tokenizer)
        if (text_encoder_3 is None) != (tokenizer_3 is None):
            raise ValueError("text_encoder_3 (T5) and tokenizer_3 come together: give both or neither")
        self.text_encoder_2, self.tokenizer_2 = text_encoder_2, tokenizer_2
        self.text_encoder_3, self.tokenizer_3 = text_encoder_3, tokenizer_3
        self.t5_tokens = int(t5_tokens)

    def to(self, device) -> "MMDiTEncoders":
        self.text_encoder_2.to(device).eval()
        if self.text_encoder_3 is not None:
            self.text_encoder_3.to(device).eval()
        return super().to(device)


T5_PARTS = ("text_encoder_3", "tokenizer_3")


def has_t5(pretrained: str | None) -> bool:
    """Whether the diffusers folder (or hub id) `pretrained` holds a T5 encoder and its tokenizer
    (`text_encoder_3/`, `tokenizer_3/`, as stable-diffusion-3-medium-diffusers does)."""
    if pretrained is None:
        return False
    local = Path(pretrained).expanduser()
    if local.exists():
        return all((local / name).is_dir() for name in T5_PARTS)
    from huggingface_hub import hf_hub_download

    with open(hf_hub_download(pretrained, "model_index.json")) as index:
        parts = json.load(index)
    return all((parts.get(name) or [None])[0] is not None for name in T5_PARTS)


def load_encoders(preset: str, pretrained: str | None = None, t5: bool = False) -> Encoders:
    """`preset`'s encoders from `pretrained`, or its random weights drawn from seed 0, so that every
    process of a run (and every run) encodes with the same ones. With `t5`, an mmdit preset's T5
    from `pretrained` too."""
    from models.build import build_encoders, load_component

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        parts = build_encoders(preset, pretrained)
    if family(preset) == "sdxl":
        return SDXLEncoders(**parts)
    if family(preset) == "mmdit":
        if t5:
            parts.update({name: load_component(name, pretrained, preset) for name in T5_PARTS})
        return MMDiTEncoders(**parts, t5_tokens=PRESETS[preset]["t5_tokens"])
    return Encoders(**parts)
