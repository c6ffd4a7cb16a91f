"""Z-Image (Tongyi-MAI): the ComposerModel of the "zimage" presets (models/families/zimage/presets.py), a
single-stream rectified-flow transformer on a decoder LLM's hidden states.

Built from diffusers' components under their names in a ZImagePipeline folder, so that an export loads
there: `transformer` (ZImageTransformer2DModel, the part that trains: it cuts 2x2 patches itself),
`vae` (FLUX.1's 16-channel AutoencoderKL, with its scale and shift), `text_encoder` (Qwen3, transformers'
Qwen3Model) with `tokenizer` and its chat template, and `noise_scheduler` (FlowMatchEulerDiscreteScheduler).
The objective is models/engine/objectives.py's RectifiedFlow, as for SD3 and FLUX.1.

The transformer reads what ZImagePipeline hands it:
- `x`: a list of (C, 1, H, W) latents (a frame axis of one), `cap_feats`: a list of each caption's
  unpadded hidden states (L_i, D) (models/engine/llm_conditioner.py), which it pads to multiples of 32
  with learned pad tokens itself;
- `t`: 1 - sigma, the time from noise to image (the pipeline's (1000 - timestep) / 1000);
- it predicts x0 - noise, the negative of the objective's velocity target (noise - x0): the pipeline
  negates its output before the Euler step, and so does `denoise`.

Classifier-free guidance is ZImagePipeline's: cond + g (cond - uncond) with g = guidance_scale (0: none),
one transformer call on the prompts then the negative prompts; what classic guidance calls scale s is
g = s - 1. Caption dropout replaces a caption's hidden states by those of the empty caption.

Batch keys: `image` (or `latents`) and `input_ids` (the chat prompt's ids, -1 where padded) or the
precomputed `text_embeds` (B, text_tokens, D), zeros where padded.
"""

import torch

from models.engine.flow_model import FlowTransformer
from models.engine.latent_diffusion import in_dtype
from models.engine.llm_conditioner import LLMHiddenStates, unpadded

PIPELINE_TIMESTEP_SCALE = 1000  # the scheduler's timesteps are sigmas x 1000


class ZImage(FlowTransformer):
    """`transformer` trains; the VAE and the LLM are frozen and stay in eval mode.

    Objective options: FlowOptions (models/engine/objectives.py), as the other flow families.
    text_tokens: the length the tokenizer pads each chat prompt to (the pipeline's max_sequence_length).
    """

    conditioner = LLMHiddenStates()
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
        super().__init__(noise_scheduler, caption_drop_prob, **objective)
        config = transformer.config
        widths = (text_encoder.config.hidden_size, vae.config.latent_channels)
        if widths != (config.cap_feat_dim, config.in_channels):
            raise ValueError(
                f"the text encoder's width and the VAE's latent channels are {widths}; the transformer "
                f"takes {(config.cap_feat_dim, config.in_channels)} (cap_feat_dim, in_channels)"
            )
        self.set_parts(
            transformer, vae, dict(text_encoder=text_encoder), dict(tokenizer=tokenizer), latent_scale,
            latent_shift, text_tokens,
        )  # fmt: skip
        self.text_tokens = int(text_tokens)

    # -- conditioning ----------------------------------------------------------------------------
    def encode_captions(self, captions: list[str], device) -> torch.Tensor:
        """(B, text_tokens, D) hidden states of the captions' chat prompts, zeros where padded."""
        ids = {name: value.to(device) for name, value in self.conditioner.ids(self, captions).items()}
        return self.conditioner.encode(self, ids)["text_embeds"]

    def empty_condition(self, device) -> torch.Tensor:
        """The empty caption's hidden states (1, text_tokens, D), once per device (empty_stored)."""
        device = torch.device(device)
        if device not in self._empty:
            self._empty[device] = self.empty_stored(device)["text_embeds"]
        return self._empty[device]

    def condition(self, batch, drop_captions: bool, image_size: tuple[int, int] | None = None) -> dict:
        """`cap_feats`, the transformer's list of unpadded hidden states, from token ids or stored
        embeddings, with caption dropout when `drop_captions` (training only)."""
        if "text_embeds" in batch:
            embeds = batch["text_embeds"].float()
        else:
            embeds = self.conditioner.encode(self, batch)["text_embeds"]
        if drop_captions:
            (embeds,) = self.caption_dropout([embeds], lambda: [self.empty_condition(embeds.device)])
        return {"cap_feats": unpadded(embeds)}

    # -- the transformer -------------------------------------------------------------------------
    def velocity(self, latents: torch.Tensor, t: torch.Tensor, cap_feats: list) -> torch.Tensor:
        """The objective's velocity (noise - x0) for (B, C, H, W) latents at time `t` = 1 - sigma: the
        transformer's output negated, as ZImagePipeline negates it."""
        out = self.transformer(
            x=list(latents.unsqueeze(2).unbind(dim=0)), t=t, cap_feats=cap_feats, return_dict=False
        )[0]
        return -torch.stack([o.float() for o in out]).squeeze(2)

    def denoise(self, noisy: torch.Tensor, timesteps: torch.Tensor, condition: dict) -> torch.Tensor:
        t = (PIPELINE_TIMESTEP_SCALE - timesteps) / PIPELINE_TIMESTEP_SCALE
        return self.velocity(noisy, t, condition["cap_feats"])

    # -- sampling --------------------------------------------------------------------------------
    def native_size(self) -> tuple[int, int]:
        """(height, width) in pixels: the VAE's sample_size (1024 for Z-Image, the pipeline's default)."""
        side = self.vae.config.sample_size
        return side, side

    def prompt_condition(self, prompts, negative_prompt: str | None, image_size=None, device=None) -> dict:
        """The guided batch's condition: the negative prompt's (or the empty caption's) per prompt, then
        the prompts'."""
        positive, negative = self.sampling_conditions(prompts, negative_prompt, device)
        return {"cap_feats": negative + positive}

    def sampling_conditions(self, prompts, negative_prompt: str | None, device) -> tuple[list, list]:
        """(positive, negative) lists of unpadded hidden states, each encoded as a batch of len(prompts),
        as ZImagePipeline.encode_prompt encodes both (a batch of one computes other last bits)."""
        positive = unpadded(self.encode_captions(list(prompts), device))
        negative = unpadded(self.encode_captions([negative_prompt or ""] * len(prompts), device))
        return positive, negative

    @torch.no_grad()
    def generate(
        self,
        prompts: list[str],
        negative_prompt: str | None = None,
        guidance_scale: float = 4.0,
        num_inference_steps: int = 25,
        height: int | None = None,
        width: int | None = None,
        seed: int = 0,
        sampler: str | None = None,
        seeds: list[int] | None = None,
        guidance_rescale: float | None = None,
    ) -> torch.Tensor:
        """Images for `prompts` (B, 3, H, W) in [0, 1]: ZImagePipeline's Euler steps (sigmas
        linspace(1, 1/steps, steps), shifted as training was) from the seeded CPU noise of
        LatentDiffusion.initial_noise, with its guidance: cond + guidance_scale (cond - uncond) against
        the negative prompt or the empty caption when guidance_scale > 0 (the pipeline's convention:
        classic guidance s is guidance_scale s - 1). `sampler` is "euler" (or None)."""
        factor = self.vae_scale_factor
        height, width = self.sampling_size(sampler, guidance_rescale, height, width, factor * 2)
        device = next(self.transformer.parameters()).device
        scheduler = self.sampling_scheduler((height, width))
        sigmas = torch.linspace(1.0, 1 / num_inference_steps, num_inference_steps).tolist()  # the pipeline's
        scheduler.set_timesteps(sigmas=sigmas, device=device)
        scheduler.set_begin_index(0)

        n, guided = len(prompts), guidance_scale > 0
        positive, negative = self.sampling_conditions(prompts, negative_prompt, device)
        dtype = self.denoiser_dtype
        cap_feats = in_dtype({"cap_feats": positive + negative if guided else positive}, dtype)["cap_feats"]
        size = (height // factor, width // factor)
        latents = self.initial_noise((n, self.vae.config.latent_channels, *size), seed, seeds).to(device)

        def velocity(latents, t):
            time = (PIPELINE_TIMESTEP_SCALE - t.expand(n)) / PIPELINE_TIMESTEP_SCALE
            model_in = latents.to(dtype)
            if not guided:
                return self.velocity(model_in, time, cap_feats)
            both = self.velocity(model_in.repeat(2, 1, 1, 1), time.repeat(2), cap_feats)
            cond, uncond = both[:n], both[n:]
            return cond + guidance_scale * (cond - uncond)

        return self.to_images(self.euler_steps(scheduler, latents, velocity))
