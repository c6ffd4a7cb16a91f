"""Flux.1 (Black Forest Labs): the ComposerModel of the "flux" presets (models/families/flux/presets.py), a
rectified-flow transformer trained as MLPerf Training's Flux.1 benchmark trains it.

Built from diffusers' components under their names in a FluxPipeline folder, so that an export loads
there (models/families/flux/folder.py): `transformer` (FluxTransformer2DModel, the part that trains), `vae`
(a 16-channel AutoencoderKL with a scale and a shift), `text_encoder` (CLIP ViT-L, CLIPTextModel) with
`tokenizer`, `text_encoder_2` (T5) with `tokenizer_2`, and `noise_scheduler`
(FlowMatchEulerDiscreteScheduler, the sampler). What every family shares (the training step's draws,
VAE moments, caption dropout, per-sample validation seeds, metrics, FLOPs per batch) is the shared
model's (models/engine/latent_diffusion.py); the objective is models/engine/objectives.py's RectifiedFlow on
x0 = (a sample of the VAE posterior - latent_shift) * latent_scale, with the flux presets' uniform
timesteps (the MLPerf reference's) unless the run says otherwise.

The transformer reads what FluxPipeline hands it:
- the latents packed into 2x2 patches, (B, C, H, W) -> (B, H/2 * W/2, 4C) (`pack`, FluxPipeline's
  `_pack_latents`), with RoPE position ids (row, column) per patch (`image_ids`, its
  `_prepare_latent_image_ids`) and zero ids for the text tokens;
- the timestep as t in (0, 1): the objective's num_train_timesteps x t divided by 1000, as the
  pipeline divides its scheduler's timesteps (the transformer multiplies by 1000 again);
- `encoder_hidden_states`, T5's last hidden states of `t5_tokens` tokens (the whole context), and
  `pooled_projections`, CLIP's pooled output (models/engine/conditioners.py PooledCLIPAndT5);
- with the guidance embedding (FLUX.1-dev's `guidance_embeds`) a guidance scale: TRAIN_GUIDANCE in
  training and validation, `generate`'s guidance_scale in sampling, as FluxPipeline's.

Caption dropout replaces a sample's context and pooled vector by those of the empty caption "" (the
MLPerf reference's empty encodings, at 10%), which `generate`'s unconditional branch uses too.

Batch keys: `image` (or `latents`: the VAE moments, unscaled and unshifted, as `sd-convert latents`
stores them) and either `input_ids` (CLIP) + `input_ids_3` (T5's, the loader's T5 column) or the
precomputed `text_embeds` (B, t5_tokens, D_T5) + `pooled_text_embeds` (B, D_CLIP).
"""

import numpy as np
import torch

from models.engine.conditioners import PooledCLIPAndT5
from models.engine.flow_model import FlowTransformer
from models.engine.latent_diffusion import in_dtype

# FluxPipeline passes `timestep / 1000` (its scheduler's timesteps are sigmas x 1000) and the
# transformer multiplies by 1000 again.
PIPELINE_TIMESTEP_SCALE = 1000
# The guidance a guidance-embedding transformer (FLUX.1-dev) is given in training: diffusers'
# examples/dreambooth/train_dreambooth_flux.py default (--guidance_scale 3.5).
TRAIN_GUIDANCE = 3.5
PATCH = 2  # FluxPipeline packs 2 x 2 latent patches


def pack(latents: torch.Tensor) -> torch.Tensor:
    """(B, C, H, W) -> (B, H/2 * W/2, 4C), as FluxPipeline._pack_latents."""
    n, c, h, w = latents.shape
    x = latents.view(n, c, h // PATCH, PATCH, w // PATCH, PATCH).permute(0, 2, 4, 1, 3, 5)
    return x.reshape(n, (h // PATCH) * (w // PATCH), c * PATCH * PATCH)


def unpack(packed: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """`pack`'s inverse for latents of height x width, as FluxPipeline._unpack_latents."""
    n, _, channels = packed.shape
    x = packed.view(n, height // PATCH, width // PATCH, channels // (PATCH * PATCH), PATCH, PATCH)
    return x.permute(0, 3, 1, 4, 2, 5).reshape(n, channels // (PATCH * PATCH), height, width)


def image_ids(height: int, width: int, device=None) -> torch.Tensor:
    """The RoPE position ids (0, row, column) of the packed patches of height x width latents, as
    FluxPipeline._prepare_latent_image_ids, in float32 (the transformer's RoPE reads them as floats)."""
    rows, columns = height // PATCH, width // PATCH
    ids = torch.zeros(rows, columns, 3, device=device)
    ids[..., 1] = torch.arange(rows, device=device)[:, None]
    ids[..., 2] = torch.arange(columns, device=device)[None, :]
    return ids.reshape(rows * columns, 3)


class Flux(FlowTransformer):
    """`transformer` trains; the VAE and both text encoders are frozen and stay in eval mode.

    Objective options: as RectifiedFlowTransformer's (models/families/mmdit/model.py), timestep_density
    included. t5_tokens: T5's length, the context's. `eval_seed` seeds validation's random draws.
    """

    conditioner = PooledCLIPAndT5()
    frozen_names = ("vae", "text_encoder", "text_encoder_2")

    def __init__(
        self,
        transformer,
        vae,
        text_encoder,
        tokenizer,
        noise_scheduler,
        *,
        text_encoder_2,
        tokenizer_2,
        latent_scale: float,
        t5_tokens: int,
        latent_shift: float = 0.0,
        caption_drop_prob: float = 0.0,
        **objective,
    ):
        super().__init__(noise_scheduler, caption_drop_prob, **objective)
        config = transformer.config
        latent_channels = vae.config.latent_channels * PATCH * PATCH
        widths = (text_encoder_2.config.d_model, text_encoder.config.hidden_size, latent_channels)
        wanted = (config.joint_attention_dim, config.pooled_projection_dim, config.in_channels)
        if widths != wanted:
            raise ValueError(
                f"T5's width, CLIP's pooled width and the packed latent channels are {widths}; the "
                f"transformer takes {wanted} (joint_attention_dim, pooled_projection_dim, in_channels)"
            )
        self.set_parts(
            transformer,
            vae,
            dict(text_encoder=text_encoder, text_encoder_2=text_encoder_2),
            dict(tokenizer=tokenizer, tokenizer_2=tokenizer_2),
            latent_scale,
            latent_shift,
            t5_tokens,
        )

    # -- conditioning ----------------------------------------------------------------------------
    def encode_captions(self, captions: list[str], device) -> tuple[torch.Tensor, torch.Tensor]:
        """(context (B, t5_tokens, D_T5), pooled (B, D_CLIP)) of captions, as FluxPipeline.encode_prompt."""
        ids = {name: value.to(device) for name, value in self.conditioner.ids(self, captions).items()}
        stored = self.conditioner.encode(self, ids)
        return stored["text_embeds"], stored["pooled_text_embeds"]

    def empty_condition(self, device) -> tuple[torch.Tensor, torch.Tensor]:
        """The empty caption's (context, pooled), (1, ...) each, made once per device from
        LatentDiffusion.empty_stored (encoded by T5 and CLIP, or the precomputed set's): what a
        dropped caption becomes and the unconditional branch's condition."""
        device = torch.device(device)
        if device not in self._empty:
            stored = self.empty_stored(device)
            self._empty[device] = (stored["text_embeds"], stored["pooled_text_embeds"])
        return self._empty[device]

    def condition(self, batch, drop_captions: bool, image_size: tuple[int, int] | None = None) -> dict:
        """`encoder_hidden_states` and `pooled_projections` from token ids or stored embeddings, with
        caption dropout when `drop_captions` (training only)."""
        if "text_embeds" in batch:
            context, pooled = batch["text_embeds"].float(), batch["pooled_text_embeds"].float()
        else:
            stored = self.conditioner.encode(self, batch)
            context, pooled = stored["text_embeds"], stored["pooled_text_embeds"]
        if drop_captions:
            context, pooled = self.caption_dropout(
                [context, pooled], lambda: self.empty_condition(context.device)
            )
        return {"encoder_hidden_states": context, "pooled_projections": pooled}

    # -- the transformer -------------------------------------------------------------------------
    def velocity(
        self, packed: torch.Tensor, size: tuple[int, int], timestep, condition: dict, guidance=None
    ) -> torch.Tensor:
        """The transformer's output (packed) for `packed` latents of `size` (height, width) and
        `timestep` t in (0, 1) per sample, as FluxPipeline calls it; `guidance`: the embedded guidance
        of a transformer that has one (None: TRAIN_GUIDANCE)."""
        height, width = size
        n, device = packed.shape[0], packed.device
        embedded = None
        if self.transformer.config.guidance_embeds:
            embedded = torch.full((n,), TRAIN_GUIDANCE if guidance is None else guidance, device=device)
        context = condition["encoder_hidden_states"]
        return self.transformer(
            hidden_states=packed,
            timestep=timestep,
            guidance=embedded,
            img_ids=image_ids(height, width, device),
            txt_ids=torch.zeros(context.shape[1], 3, device=device),
            **condition,
        ).sample

    def denoise(self, noisy: torch.Tensor, timesteps: torch.Tensor, condition: dict) -> torch.Tensor:
        height, width = noisy.shape[-2:]
        timesteps = timesteps / PIPELINE_TIMESTEP_SCALE
        return unpack(self.velocity(pack(noisy), (height, width), timesteps, condition), height, width)

    # -- sampling --------------------------------------------------------------------------------
    def native_size(self) -> tuple[int, int]:
        """(height, width) in pixels: the VAE's sample_size (FLUX.1's 1024, FluxPipeline's default)."""
        side = self.vae.config.sample_size
        return side, side

    def prompt_condition(
        self, prompts: list[str], negative_prompt: str | None, image_size=None, device=None
    ) -> dict:
        """The conditioning of a guided batch: the negative prompt's (or the empty caption's) for each
        prompt first, then the prompts' (`sampling_conditions`, the negative one repeated)."""
        negative, positive = self.sampling_conditions(prompts, negative_prompt, device)
        n = len(prompts)
        return {
            key: torch.cat([negative[key].expand(n, *value.shape[1:]), value])
            for key, value in positive.items()
        }

    def sampling_conditions(
        self, prompts: list[str], negative_prompt: str | None, device
    ) -> tuple[dict, dict]:
        """(negative, positive) conditions: the prompts' (B, ...), and the negative prompt's (or the
        empty caption's) encoded once, (1, ...), which the transformer broadcasts, as FluxPipeline
        encodes a negative prompt string (a batch of one computes other last bits than a batch of n)."""
        conditions = []
        for captions in ([negative_prompt or ""], list(prompts)):
            context, pooled = self.encode_captions(captions, device)
            conditions.append({"encoder_hidden_states": context, "pooled_projections": pooled})
        return conditions[0], conditions[1]

    @torch.no_grad()
    def generate(
        self,
        prompts: list[str],
        negative_prompt: str | None = None,
        guidance_scale: float = 5.0,
        num_inference_steps: int = 25,
        height: int | None = None,
        width: int | None = None,
        seed: int = 0,
        sampler: str | None = None,
        seeds: list[int] | None = None,
        guidance_rescale: float | None = None,
    ) -> torch.Tensor:
        """Images for `prompts` (B, 3, H, W) in [0, 1]: FluxPipeline's Euler steps (sigmas
        linspace(1, 1/steps, steps), shifted as training was, `sampling_scheduler`) from the seeded
        CPU noise of LatentDiffusion.initial_noise.

        guidance_scale: without the guidance embedding (schnell's architecture, MLPerf's), classifier-
        free guidance against the negative prompt or the empty caption when > 1, which FluxPipeline
        does as `true_cfg_scale` with `negative_prompt` ("" for none); with it (dev's), the embedded
        guidance, FluxPipeline's `guidance_scale`, and no second branch. An export's README.md says
        which. `sampler` is "euler" (or None); `guidance_rescale` must be 0 or None.
        """
        factor = self.vae_scale_factor
        height, width = self.sampling_size(sampler, guidance_rescale, height, width, factor * PATCH)
        device = next(self.transformer.parameters()).device
        scheduler = self.sampling_scheduler((height, width))
        sigmas = np.linspace(1.0, 1 / num_inference_steps, num_inference_steps)  # FluxPipeline's
        scheduler.set_timesteps(sigmas=sigmas, device=device)
        scheduler.set_begin_index(0)

        n, embedded = len(prompts), self.transformer.config.guidance_embeds
        guided = guidance_scale > 1 and not embedded
        negative, positive = self.sampling_conditions(prompts, negative_prompt, device)
        negative, positive = in_dtype(negative, self.denoiser_dtype), in_dtype(positive, self.denoiser_dtype)
        size = (height // factor, width // factor)
        noise = self.initial_noise((n, self.vae.config.latent_channels, *size), seed, seeds)
        latents = pack(noise.to(device))  # fp32, as FluxPipeline's (its text encoders' dtype)
        guidance = guidance_scale if embedded else None

        def velocity(latents, t):
            timestep = t.expand(n).to(latents.dtype) / PIPELINE_TIMESTEP_SCALE
            model_in = latents.to(self.denoiser_dtype)
            velocity = self.velocity(model_in, size, timestep, positive, guidance).float()
            if guided:  # FluxPipeline's true CFG: a second call on the negative condition
                uncond = self.velocity(model_in, size, timestep, negative, guidance).float()
                velocity = uncond + guidance_scale * (velocity - uncond)
            return velocity

        return self.to_images(unpack(self.euler_steps(scheduler, latents, velocity), *size))
