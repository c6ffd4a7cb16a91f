"""FLUX.2 (Black Forest Labs): the ComposerModel of the "flux2" presets (models/families/flux2/presets.py),
a rectified-flow transformer on three stacked layers of a decoder LLM's hidden states.

Built from diffusers' components under their names in a Flux2KleinPipeline folder, so that an export loads
there: `transformer` (Flux2Transformer2DModel, the part that trains), `vae` (AutoencoderKLFlux2: 32
latent channels and a BatchNorm2d whose running stats normalise the 2x2-patchified latents), `text_encoder`
(Qwen3ForCausalLM; FLUX.2-dev's Mistral 3, for planning) with `tokenizer`, and `noise_scheduler`.
Line numbers below are diffusers 0.42.1's pipelines/flux2/pipeline_flux2_klein.py (NOTES.md says more).

The model's latents are the VAE's (B, 32, h, w), normalised as the pipeline normalises them: cut into
2x2 patches (B, 128, h/2, w/2) (`_patchify_latents`, 371-376), minus vae.bn.running_mean, over
sqrt(running_var + eps) (`_encode_vae_image`, 471-475), and put back in place, so that the objective's
draws keep the VAE's shape; `denoise` cuts the patches again and packs them into tokens (389-397). The
noise is i.i.d., so where it is drawn changes nothing in training; `generate` draws it in the pipeline's
patch space (480-511) to sample the pipeline's image bit for bit.

The transformer reads:
- `hidden_states` (B, h/2 * w/2, 128) with 4-axis position ids (t, h, w, l) = (0, row, col, 0) (287-316);
- `encoder_hidden_states` (B, text_tokens, 3 D): all rows, the padded ones too, with ids (0, 0, 0, l)
  (267-283) and no text mask (the pipeline passes none, 851-860);
- `timestep` sigma in (0, 1): the scheduler's timestep / 1000 (853); it predicts the velocity
  noise - x0, the objective's target as it is (no sign flip, unlike Z-Image);
- `guidance`: None for klein (854); FLUX.2-dev's embedded guidance, TRAIN_GUIDANCE in training.

Classifier-free guidance is Flux2KleinPipeline's (864-877): a second call on the empty caption's
context, uncond + g (cond - uncond), when g > 1 (classic scale; the distilled klein folders skip it).
"""

import numpy as np
import torch
from diffusers import FlowMatchEulerDiscreteScheduler
from diffusers.pipelines.flux2.pipeline_flux2_klein import compute_empirical_mu

from models.engine.flow_model import FlowTransformer
from models.engine.latent_diffusion import in_dtype
from models.engine.llm_conditioner import LLMHiddenStates
from models.families.flux2.presets import PUBLISHED_SCHEDULER, TRAIN_SCHEDULER

PIPELINE_TIMESTEP_SCALE = 1000  # the scheduler's timesteps are sigmas x 1000 (klein.py:853: t / 1000)
# FLUX.2-dev's embedded guidance in training: diffusers' train_dreambooth_lora_flux2*.py default
# --guidance_scale 3.5, used where the transformer has `guidance_embeds` (klein has none).
TRAIN_GUIDANCE = 3.5


def patchify(latents: torch.Tensor) -> torch.Tensor:
    """(B, C, h, w) -> (B, 4C, h/2, w/2), channel c * 4 + 2 dy + dx (klein.py:371-376)."""
    n, c, h, w = latents.shape
    x = latents.view(n, c, h // 2, 2, w // 2, 2).permute(0, 1, 3, 5, 2, 4)
    return x.reshape(n, c * 4, h // 2, w // 2)


def unpatchify(latents: torch.Tensor) -> torch.Tensor:
    """`patchify`'s inverse (klein.py:380-385)."""
    n, c, h, w = latents.shape
    x = latents.reshape(n, c // 4, 2, 2, h, w).permute(0, 1, 4, 2, 5, 3)
    return x.reshape(n, c // 4, h * 2, w * 2)


def pack(patches: torch.Tensor) -> torch.Tensor:
    """(B, C, H, W) -> (B, H * W, C), row-major tokens (klein.py:389-397)."""
    n, c, h, w = patches.shape
    return patches.reshape(n, c, h * w).permute(0, 2, 1)


def unpack(tokens: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """`pack`'s inverse for H x W tokens: the scatter by position ids of klein.py:400-427, whose ids are
    row-major (`image_ids`), so a reshape."""
    return tokens.permute(0, 2, 1).reshape(tokens.shape[0], tokens.shape[2], height, width)


def image_ids(n: int, height: int, width: int, device=None) -> torch.Tensor:
    """(B, H * W, 4) int64 ids (0, row, col, 0) of H x W tokens (`_prepare_latent_ids`, klein.py:287-316)."""
    one = torch.arange(1)
    ids = torch.cartesian_prod(one, torch.arange(height), torch.arange(width), one)
    return ids.unsqueeze(0).expand(n, -1, -1).to(device)


def text_ids(n: int, length: int, device=None) -> torch.Tensor:
    """(B, L, 4) int64 ids (0, 0, 0, l) of the context's rows (`_prepare_text_ids`, klein.py:267-283)."""
    one = torch.arange(1)
    return torch.cartesian_prod(one, one, one, torch.arange(length)).expand(n, -1, -1).to(device)


def quarter_layers(depth: int) -> tuple[int, ...]:
    """The hidden_states FLUX.2 stacks: at 1/4, 2/4, 3/4 of the encoder's depth. Klein's (9, 18, 27) of
    Qwen3's 36 layers (klein.py:636 text_encoder_out_layers), dev's (10, 20, 30) of Mistral's 40
    (pipeline_flux2.py:767), the toy's (1, 2, 3) of 4 (presets.py `text_encoder_layers`)."""
    return tuple(depth * k // 4 for k in (1, 2, 3))


class QuarterLayers(LLMHiddenStates):
    """klein's conditioner: LLMHiddenStates with thinking off and the padded rows kept (tests/
    test_llm_conditioner.py: Flux2KleinPipeline._get_qwen3_prompt_embeds bit for bit), at the layers
    `quarter_layers` picks for the encoder it is given."""

    def __init__(self):
        super().__init__(thinking=False, keep_padding=True)

    def encode(self, parts, ids) -> dict[str, torch.Tensor]:
        depth = parts.text_encoder.config.get_text_config().num_hidden_layers
        return LLMHiddenStates(quarter_layers(depth), self.thinking, self.keep_padding).encode(parts, ids)


class Flux2(FlowTransformer):
    """`transformer` trains; the VAE and the LLM are frozen and stay in eval mode.

    Objective options: FlowOptions (models/engine/objectives.py), as the other flow families; sampling
    takes the pipeline's empirical shift instead (`sampling_scheduler`).
    text_tokens: the length the tokenizer pads each chat prompt to (the pipeline's max_sequence_length).
    """

    conditioner = QuarterLayers()
    frozen_names = ("vae", "text_encoder")

    def __init__(
        self,
        transformer,
        vae,
        text_encoder,
        tokenizer,
        noise_scheduler,
        *,
        latent_scale: float,
        text_tokens: int,
        latent_shift: float = 0.0,
        caption_drop_prob: float = 0.0,
        **objective,
    ):
        if noise_scheduler.config.get("use_dynamic_shifting"):  # a FLUX.2 folder's (PUBLISHED_SCHEDULER)
            # What it trains with: its training grid is left unshifted (diffusers 0.42.1
            # scheduling_flow_match_euler_discrete.py:127-135), as in train_dreambooth_lora_flux2_klein.py.
            noise_scheduler = FlowMatchEulerDiscreteScheduler.from_config(
                noise_scheduler.config, **TRAIN_SCHEDULER
            )
        super().__init__(noise_scheduler, caption_drop_prob, **objective)
        config = transformer.config
        width = text_encoder.config.get_text_config().hidden_size
        widths = (3 * width, vae.config.latent_channels * 4)
        if widths != (config.joint_attention_dim, config.in_channels):
            raise ValueError(
                f"3 x the text encoder's width and the patched latent channels are {widths}; the transformer "
                f"takes {(config.joint_attention_dim, config.in_channels)} (joint_attention_dim, in_channels)"
            )
        self.set_parts(
            transformer, vae, dict(text_encoder=text_encoder), dict(tokenizer=tokenizer), latent_scale,
            latent_shift, text_tokens,
        )  # fmt: skip
        self.text_tokens = int(text_tokens)

    # -- latents: the VAE's batch-norm statistics ------------------------------------------------------
    def _bn(self, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(mean, std) of the patched latents' channels, as klein.py:471-475 and 910-914 compute them."""
        bn = self.vae.bn
        mean = bn.running_mean.view(1, -1, 1, 1).to(like.device, like.dtype)
        std = torch.sqrt(bn.running_var.view(1, -1, 1, 1) + self.vae.config.batch_norm_eps)
        return mean, std.to(like.device, like.dtype)

    def scale_latents(self, sample: torch.Tensor) -> torch.Tensor:
        patches = patchify((sample - self.latent_shift) * self.latent_scale)
        mean, std = self._bn(patches)
        return unpatchify((patches - mean) / std)

    def unscale_latents(self, latents: torch.Tensor) -> torch.Tensor:
        patches = patchify(latents)
        mean, std = self._bn(patches)
        return unpatchify(patches * std + mean) / self.latent_scale + self.latent_shift

    # -- conditioning ----------------------------------------------------------------------------
    def encode_captions(self, captions: list[str], device) -> torch.Tensor:
        """(B, text_tokens, 3 D): the captions' chat prompts' stacked hidden states, padded rows kept."""
        ids = {name: value.to(device) for name, value in self.conditioner.ids(self, captions).items()}
        return self.conditioner.encode(self, ids)["text_embeds"]

    def empty_condition(self, device) -> torch.Tensor:
        """The empty caption's context (1, text_tokens, 3 D), once per device (empty_stored)."""
        device = torch.device(device)
        if device not in self._empty:
            self._empty[device] = self.empty_stored(device)["text_embeds"]
        return self._empty[device]

    def condition(self, batch, drop_captions: bool, image_size: tuple[int, int] | None = None) -> dict:
        """`encoder_hidden_states` from token ids or stored embeddings, with caption dropout to the empty
        caption's (diffusers' klein training example's --caption_dropout) when `drop_captions`."""
        if "text_embeds" in batch:
            context = batch["text_embeds"].float()
        else:
            context = self.conditioner.encode(self, batch)["text_embeds"]
        if drop_captions:
            (context,) = self.caption_dropout([context], lambda: [self.empty_condition(context.device)])
        return {"encoder_hidden_states": context}

    # -- the transformer -------------------------------------------------------------------------
    def velocity(self, tokens, size, sigma, context, guidance=None) -> torch.Tensor:
        """The transformer's velocity (B, H * W, 128) for `tokens` of `size` (H, W) at `sigma` (B,),
        called as klein.py:851-860 calls it; `guidance`: dev's embedded guidance (None: TRAIN_GUIDANCE)."""
        n, device = tokens.shape[0], tokens.device
        embedded = None
        if self.transformer.config.guidance_embeds:
            embedded = torch.full((n,), TRAIN_GUIDANCE if guidance is None else guidance, device=device)
        return self.transformer(
            hidden_states=tokens,
            timestep=sigma,
            guidance=embedded,
            encoder_hidden_states=context,
            txt_ids=text_ids(n, context.shape[1], device),
            img_ids=image_ids(n, *size, device),
            return_dict=False,
        )[0]

    def denoise(self, noisy: torch.Tensor, timesteps: torch.Tensor, condition: dict) -> torch.Tensor:
        patches = patchify(noisy)
        size = tuple(patches.shape[-2:])
        sigma = timesteps / PIPELINE_TIMESTEP_SCALE
        out = self.velocity(pack(patches), size, sigma, condition["encoder_hidden_states"])
        return unpatchify(unpack(out, *size))

    # -- sampling --------------------------------------------------------------------------------
    def native_size(self) -> tuple[int, int]:
        """(height, width) in pixels: the VAE's sample_size (1024, the pipeline's default, klein.py:786)."""
        side = self.vae.config.sample_size
        return side, side

    def sampling_scheduler(self, image_size=None) -> FlowMatchEulerDiscreteScheduler:
        """The published folders' scheduler (dynamic shifting), what an export writes: the pipeline sets
        its timesteps with `mu` per resolution and step count (`sampling_sigmas`), whatever shift
        training used."""
        return FlowMatchEulerDiscreteScheduler.from_config(PUBLISHED_SCHEDULER)

    def prompt_condition(self, prompts, negative_prompt: str | None, image_size=None, device=None) -> dict:
        """The guided batch's condition: the negative prompt's (or the empty caption's) per prompt, then
        the prompts'."""
        negative, positive = self.sampling_conditions(prompts, negative_prompt, device)
        return {"encoder_hidden_states": torch.cat([negative, positive])}

    def sampling_conditions(self, prompts, negative_prompt: str | None, device):
        """(negative, positive) contexts, each encoded as a batch of len(prompts) as the pipeline encodes
        both (klein.py:749-760: its negative is always ""; `negative_prompt` replaces it here)."""
        positive = self.encode_captions(list(prompts), device)
        return self.encode_captions([negative_prompt or ""] * len(prompts), device), positive

    @torch.no_grad()
    def generate(
        self,
        prompts: list[str],
        negative_prompt: str | None = None,
        guidance_scale: float = 4.0,
        num_inference_steps: int = 50,
        height: int | None = None,
        width: int | None = None,
        seed: int = 0,
        sampler: str | None = None,
        seeds: list[int] | None = None,
        guidance_rescale: float | None = None,
    ) -> torch.Tensor:
        """Images for `prompts` (B, 3, H, W) in [0, 1], as Flux2KleinPipeline samples them: noise
        (B, 128, H/16, W/16) from LatentDiffusion.initial_noise's seeded CPU generator (klein.py:480-511),
        `flux2_euler` and the pipeline's decoding (907-921). guidance_scale > 1: classic classifier-free
        guidance against the negative prompt or "" (864-877); FLUX.2-dev embeds it instead."""
        factor = self.vae_scale_factor * 2
        height, width = self.sampling_size(sampler, guidance_rescale, height, width, factor)
        device = next(self.transformer.parameters()).device
        positive, negative = self.sampling_conditions(prompts, negative_prompt, device)[::-1]
        size, n = (height // factor, width // factor), len(prompts)
        channels = self.transformer.config.in_channels
        noise = self.initial_noise((n, channels, *size), seed, seeds).to(device, positive.dtype)
        embedded = self.transformer.config.guidance_embeds
        scale = None if embedded or guidance_scale <= 1 else guidance_scale
        contexts = in_dtype({"p": positive, "n": negative}, self.denoiser_dtype)
        calls = (contexts["p"],) if scale is None else (contexts["p"], contexts["n"])
        guidance = guidance_scale if embedded else None
        tokens = flux2_euler(self, pack(noise), size, calls, scale, guidance, num_inference_steps)
        return self.to_images(unpatchify(unpack(tokens, *size)))


def flux2_euler(model: Flux2, tokens, size, contexts, scale, guidance, steps: int) -> torch.Tensor:
    """Flux2KleinPipeline's loop: sigmas linspace(1, 1/steps, steps) shifted by compute_empirical_mu of
    the token count and step count (klein.py:814-825), Euler steps of the velocity of `contexts[0]`,
    guided uncond + scale (cond - uncond) with `contexts[1]` as the second call (864-877) when `scale`."""
    scheduler = model.sampling_scheduler()
    sigmas = np.linspace(1.0, 1 / steps, steps)
    mu = compute_empirical_mu(image_seq_len=tokens.shape[1], num_steps=steps)
    scheduler.set_timesteps(sigmas=sigmas, mu=mu, device=tokens.device)
    scheduler.set_begin_index(0)

    def velocity(latents, t):
        sigma = t.expand(latents.shape[0]).to(latents.dtype) / PIPELINE_TIMESTEP_SCALE
        model_in = latents.to(model.denoiser_dtype)
        cond = model.velocity(model_in, size, sigma, contexts[0], guidance)
        if scale is None:
            return cond
        uncond = model.velocity(model_in, size, sigma, contexts[1], guidance)
        return uncond + scale * (cond - uncond)

    return model.euler_steps(scheduler, tokens, velocity)
