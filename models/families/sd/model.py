"""The Stable Diffusion ComposerModel: a trainable UNet conditioned on a frozen text encoder, trained
on the latents of a frozen VAE with the DDPM objective (models/engine/objectives.py). The step, validation,
caption dropout's mask and FLOPs are the shared model's (models/engine/latent_diffusion.py); here are the
UNet's call, the text condition and DDPM sampling with classifier-free guidance.
"""

import torch
from diffusers import DDIMScheduler

from compat.diffusers import rescale_noise_cfg
from models.engine.conditioners import CLIPText
from models.engine.latent_diffusion import LatentDiffusion, in_dtype
from models.engine.objectives import DDPM, forwarded
from models.engine.tokenizer import tokenize


class StableDiffusion(LatentDiffusion):
    """`unet` trains; `vae` and `text_encoder` are frozen and stay in eval mode.

    Objective options (prediction_type "epsilon" or "v_prediction", offset_noise, min_snr_gamma): the
    DDPM objective's (models/engine/objectives.py), `self.objective`; the attributes of the same names and
    `noise_scheduler` read and set its.
        caption_drop_prob: replaces a sample's text condition by the empty caption's, which trains
            the unconditional branch that classifier-free guidance needs (SD used 0.1).

    `eval_seed` seeds validation's random draws (see `eval_forward`).
    """

    conditioner = CLIPText()  # the text encoder's call (models/engine/conditioners.py)

    def __init__(
        self,
        unet,
        vae,
        text_encoder,
        tokenizer,
        noise_scheduler,
        *,
        latent_scale: float,
        prediction_type: str = "epsilon",
        offset_noise: float = 0.0,
        min_snr_gamma: float | None = None,
        caption_drop_prob: float = 0.0,
    ):
        super().__init__(
            DDPM(noise_scheduler, prediction_type, offset_noise, min_snr_gamma), caption_drop_prob
        )
        self.unet = unet
        self.vae = vae.requires_grad_(False).eval()
        self.text_encoder = text_encoder.requires_grad_(False).eval()
        self.tokenizer = tokenizer
        # A buffer, so checkpoints carry it: a VAE trained here has its own scale (models/autoencoder.py).
        self.register_buffer("latent_scale", torch.tensor(float(latent_scale)))
        # Sharding only the UNet: the frozen parts are small next to it and have no optimizer state.
        self.unet._fsdp_wrap = True
        self.vae._fsdp_wrap = False
        self.text_encoder._fsdp_wrap = False

    # The objective's attributes, which code and tests read (and set) on the model.
    noise_scheduler = forwarded("scheduler")
    prediction_type = forwarded("prediction_type")
    offset_noise = forwarded("offset_noise")
    min_snr_gamma = forwarded("min_snr_gamma")
    zero_terminal_snr = forwarded("zero_terminal_snr", settable=False)

    @property
    def default_guidance_rescale(self) -> float:
        """0.7 for a zero-terminal-SNR model (Lin et al. 2023, section 3.4), else 0 (no rescale)."""
        return 0.7 if self.zero_terminal_snr else 0.0

    # -- conditioning ----------------------------------------------------------------------------
    def scale_latents(self, sample: torch.Tensor) -> torch.Tensor:
        """A VAE latent sample -> what the UNet models: sample * scale."""
        return sample * self.latent_scale

    def encode_text(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.conditioner.encode(self, {"input_ids": input_ids})["text_embeds"]

    def empty_text_embedding(self, device) -> torch.Tensor:
        """The embedding of "" (1, 77, D): the unconditional branch's condition. The text encoder is
        frozen, so it is made once per device (LatentDiffusion.empty_stored: encoded, or the
        precomputed set's)."""
        device = torch.device(device)
        if device not in self._empty:
            self._empty[device] = self.empty_stored(device)["text_embeds"]
        return self._empty[device]

    def _context(self, batch, drop_captions: bool = True) -> torch.Tensor:
        if "text_embeds" in batch:
            context = batch["text_embeds"].float()
        else:
            context = self.encode_text(batch["input_ids"])
        if not drop_captions:
            return context
        (context,) = self.caption_dropout([context], lambda: [self.empty_text_embedding(context.device)])
        return context

    def condition(self, batch, drop_captions: bool, image_size: tuple[int, int]) -> dict:
        """The UNet's keyword arguments besides the noisy latents and timesteps, for a batch of images of
        `image_size` (height, width) pixels: here the text context; SDXL adds its pooled text vector
        and micro-conditioning (models/families/sdxl/model.py)."""
        return {"encoder_hidden_states": self._context(batch, drop_captions)}

    def denoise(self, noisy: torch.Tensor, timesteps: torch.Tensor, condition: dict) -> torch.Tensor:
        return self.unet(noisy, timesteps, **condition).sample

    def pipeline_parts(self) -> dict:
        """The keywords of the family's diffusers pipeline (models/export.py writes it)."""
        return dict(
            vae=self.vae,
            text_encoder=self.text_encoder,
            tokenizer=self.tokenizer,
            unet=self.unet,
            # The training schedule (and prediction_type) with the deterministic DDIM sampler, which is
            # also `generate`'s default.
            scheduler=DDIMScheduler.from_config(self.noise_scheduler.config),
            safety_checker=None,
            feature_extractor=None,
            requires_safety_checker=False,
        )

    # -- sampling --------------------------------------------------------------------------------
    def prompt_condition(self, prompts: list[str], negative_prompt: str | None, image_size, device) -> dict:
        """The UNet's conditioning for a guided batch: the negative prompt's (or the empty caption's)
        for each prompt first, then the prompts' (`generate` runs [latents, latents] through it)."""
        n = len(prompts)
        ids = tokenize(self.tokenizer, prompts + [negative_prompt or ""] * n).to(device)
        context = self.encode_text(ids)
        return {"encoder_hidden_states": torch.cat([context[n:], context[:n]])}

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
        sampler: str = "ddim",
        seeds: list[int] | None = None,
        guidance_rescale: float | None = None,
    ) -> torch.Tensor:
        """Images for `prompts` as a float tensor (B, 3, H, W) in [0, 1], with classifier-free guidance.

        The initial noise comes from a CPU generator seeded with `seed`, so the same seed gives the
        same image on any device. `seeds` (one per prompt) draws each image's noise from its own
        generator instead, so an image does not depend on which others share its batch.
        `guidance_rescale` (diffusers' `rescale_noise_cfg`, as its pipelines apply it) defaults to
        `default_guidance_rescale`: 0.7 for a zero-terminal-SNR model, else 0.
        """
        if guidance_rescale is None:
            guidance_rescale = self.default_guidance_rescale
        scheduler = self.objective.sampler(sampler)
        device = next(self.unet.parameters()).device
        scheduler.set_timesteps(num_inference_steps, device=device)
        factor = self.vae_scale_factor
        height = height or self.unet.config.sample_size * factor
        width = width or self.unet.config.sample_size * factor

        n = len(prompts)
        dtype = self.denoiser_dtype
        condition = self.prompt_condition(list(prompts), negative_prompt, (height, width), device)
        condition = in_dtype(condition, dtype)
        shape = (n, self.unet.config.in_channels, height // factor, width // factor)
        latents = self.initial_noise(shape, seed, seeds).to(device) * scheduler.init_noise_sigma
        was_training = self.unet.training
        self.unet.eval()
        for t in scheduler.timesteps:
            model_in = scheduler.scale_model_input(torch.cat([latents, latents]), t)
            eps = self.unet(model_in.to(dtype), t, **condition).sample.float()
            eps_uncond, eps_cond = eps.chunk(2)
            eps = eps_uncond + guidance_scale * (eps_cond - eps_uncond)
            if guidance_rescale > 0:
                eps = rescale_noise_cfg(eps, eps_cond, guidance_rescale=guidance_rescale)
            latents = scheduler.step(eps, t, latents).prev_sample
        self.unet.train(was_training)
        images = self.vae.decode(latents / self.latent_scale).sample
        return (images.float() / 2 + 0.5).clamp(0, 1)
