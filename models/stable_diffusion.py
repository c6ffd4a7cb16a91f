"""The Stable Diffusion ComposerModel: a trainable UNet conditioned on a frozen text encoder, trained
on the latents of a frozen VAE with the DDPM objective.

A batch holds either images and token ids (`image` in [-1, 1], or uint8 as the data loader hands it
over: models/pixels.py; `input_ids`) or what `python -m convert latents` precomputed from them
(`latents`: the VAE's Gaussian moments, unscaled; `text_embeds`). Both paths sample the latent from
the moments and apply `latent_scale` once, here, so the loss is the same for the same noise and
timesteps.

Training draws its latent samples, noise, timesteps and caption dropout from the global RNG (which
Composer seeds and checkpoints). Validation (`eval_forward`) draws them from generators seeded per
sample, so a checkpoint's validation loss is the same number each time it is measured.
"""

import hashlib

import torch
from composer.models import ComposerModel
from torchmetrics import MeanSquaredError

from compat.diffusers import DiagonalGaussianDistribution, rescale_noise_cfg
from models.flops import unet_training_flops
from models.objectives import DDPM, SAMPLERS, forwarded, seeded_draws  # noqa: F401 (SAMPLERS: imported from here)
from models.pixels import to_float
from models.tokenizer import tokenize


class StableDiffusion(ComposerModel):
    """`unet` trains; `vae` and `text_encoder` are frozen and stay in eval mode.

    Objective options (prediction_type "epsilon" or "v_prediction", offset_noise, min_snr_gamma): the
    DDPM objective's (models/objectives.py), `self.objective`; the attributes of the same names and
    `noise_scheduler` read and set its.
        caption_drop_prob: replaces a sample's text condition by the empty caption's, which trains
            the unconditional branch that classifier-free guidance needs (SD used 0.1).

    `eval_seed` seeds validation's random draws (see `eval_forward`).
    """

    eval_seed: int = 0

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
        super().__init__()
        if not 0.0 <= caption_drop_prob <= 1.0:
            raise ValueError(f"caption_drop_prob must be in [0, 1], not {caption_drop_prob}")
        self.objective = DDPM(noise_scheduler, prediction_type, offset_noise, min_snr_gamma)
        self.unet = unet
        self.vae = vae.requires_grad_(False).eval()
        self.text_encoder = text_encoder.requires_grad_(False).eval()
        self.tokenizer = tokenizer
        # A buffer, so checkpoints carry it: a VAE trained here has its own scale (models/autoencoder.py).
        self.register_buffer("latent_scale", torch.tensor(float(latent_scale)))
        self.caption_drop_prob = caption_drop_prob
        self.val_mse = MeanSquaredError()
        self._empty_embedding: dict[torch.device, torch.Tensor] = {}
        # Sharding only the UNet: the frozen parts are small next to it and have no optimizer state.
        self.unet._fsdp_wrap = True
        self.vae._fsdp_wrap = False
        self.text_encoder._fsdp_wrap = False

    def train(self, mode: bool = True):
        # Composer toggles train()/eval() on the whole model; the frozen parts must never leave eval.
        super().train(mode)
        self.vae.eval()
        self.text_encoder.eval()
        return self

    @property
    def denoiser(self) -> torch.nn.Module:
        """The trained network, whatever the family calls it (here the UNet; an mmdit model's
        transformer): for code that handles every family (export, EMA, sharding checks)."""
        return self.unet

    @property
    def denoiser_dtype(self) -> torch.dtype:
        """The dtype of the denoiser's weights: fp32, or bf16 with model.param_dtype (models/build.py).
        Its inputs are cast to it where the model calls it, so it runs outside autocast too (on the
        CPU, in sampling); its output is read back in fp32 (the loss, the sampler's steps)."""
        return next(self.denoiser.parameters()).dtype

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

    @property
    def vae_scale_factor(self) -> int:
        return 2 ** (len(self.vae.config.block_out_channels) - 1)

    # -- conditioning ----------------------------------------------------------------------------
    @torch.no_grad()
    def vae_moments(self, images: torch.Tensor) -> torch.Tensor:
        """The VAE posterior's (mean, logvar), concatenated on channels: what `convert latents` stores.
        `images` in [-1, 1], or uint8 as the data loader hands them over (converted here, on their device)."""
        return self.vae.encode(to_float(images)).latent_dist.parameters

    def sample_latents(self, moments: torch.Tensor) -> torch.Tensor:
        return DiagonalGaussianDistribution(moments.float()).sample() * self.latent_scale

    @torch.no_grad()
    def encode_text(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.text_encoder(input_ids)[0]

    def empty_text_embedding(self, device) -> torch.Tensor:
        """The embedding of "" (1, 77, D): the unconditional branch's condition. The text encoder is
        frozen, so it is encoded once per device (and again after load_state_dict)."""
        device = torch.device(device)
        if device not in self._empty_embedding:
            self._empty_embedding[device] = self.encode_text(tokenize(self.tokenizer, [""]).to(device))
        return self._empty_embedding[device]

    def load_state_dict(self, *args, **kwargs):
        self._empty_embedding.clear()  # the text encoder's weights may change
        return super().load_state_dict(*args, **kwargs)

    def _context(self, batch, drop_captions: bool = True) -> torch.Tensor:
        if "text_embeds" in batch:
            context = batch["text_embeds"].float()
        else:
            context = self.encode_text(batch["input_ids"])
        if not drop_captions:
            return context
        drop = self._drop_mask(context.shape[0], context.device)
        # No `if drop.any()`: that would wait for the GPU every step to save one cheap where().
        return torch.where(drop[:, None, None], self.empty_text_embedding(context.device), context)

    def _drop_mask(self, n: int, device) -> torch.Tensor:
        if not self.training or self.caption_drop_prob == 0.0:
            return torch.zeros(n, dtype=torch.bool, device=device)
        return torch.rand(n, device=device) < self.caption_drop_prob

    def condition(self, batch, drop_captions: bool, image_size: tuple[int, int]) -> dict:
        """The UNet's keyword arguments besides the noisy latents and timesteps, for a batch of images of
        `image_size` (height, width) pixels: here the text context; SDXL adds its pooled text vector
        and micro-conditioning (models/sdxl.py)."""
        return {"encoder_hidden_states": self._context(batch, drop_captions)}

    # -- training --------------------------------------------------------------------------------
    def forward(self, batch):
        return self._diffuse(batch)

    def _diffuse(self, batch, seeds: list[int] | None = None):
        """(prediction, target, timesteps) of the objective; the random draws come from the global RNG
        (the latent sample, caption dropout, then the objective's), or with `seeds` (one per sample)
        from the objective's `seeded_draws`, with no caption dropout."""
        moments = batch["latents"] if "latents" in batch else self.vae_moments(batch["image"])
        image_size = (moments.shape[-2] * self.vae_scale_factor, moments.shape[-1] * self.vae_scale_factor)
        if seeds is None:
            latents = self.sample_latents(moments)
            condition = self.condition(batch, True, image_size)
            draws = self.objective.draws(latents)
        else:
            posterior = DiagonalGaussianDistribution(moments.float())
            draws = self.objective.seeded_draws(seeds, posterior.mean.shape[1:], moments.device)
            latents = (posterior.mean + posterior.std * draws["latent"]) * self.latent_scale
            condition = self.condition(batch, False, image_size)
        noisy, timesteps, target, level = self.objective.diffuse(latents, draws, image_size)
        dtype = self.denoiser_dtype
        prediction = self.unet(noisy.to(dtype), timesteps, **in_dtype(condition, dtype)).sample
        return prediction, target, level

    def loss(self, outputs, batch):
        return self.objective.loss(*outputs)

    # -- evaluation ------------------------------------------------------------------------------
    def eval_forward(self, batch, outputs=None):
        """Validation outputs: like `forward`, but the latent sample, noise, offset noise and timestep of
        each sample come from a CPU generator seeded with `eval_seeds` (the eval seed and a hash of the
        sample's content), never from the global RNG, and no caption is dropped (even in train mode).

        Seeding from the content rather than from a batch counter makes the draws a property of the
        sample: the same sample of the same checkpoint gets the same noise every evaluation, however
        many training steps ran before, in any batch, at any batch size or number of devices; and an
        evaluation during training consumes none of the training's random numbers. (Two identical
        samples get identical draws, which only makes them count twice.)
        """
        if outputs is not None:
            return outputs
        return self._diffuse(batch, seeds=self.eval_seeds(batch))

    def eval_seeds(self, batch) -> list[int]:
        """One 63-bit seed per sample: blake2b of `eval_seed`, the sample's pixels (or precomputed
        latent moments) and its token ids (or text embeddings), as raw bytes. Costs a copy of the batch
        to the CPU and about 3 ms per 256 px image (one core); validation only."""
        # uint8 images hash as their floats: the same seeds whichever the loader hands over.
        pixels = batch["latents"] if "latents" in batch else to_float(batch["image"])
        text = batch["text_embeds"] if "text_embeds" in batch else batch["input_ids"]
        pixels, text = pixels.detach().cpu().contiguous(), text.detach().cpu().contiguous()
        seeds = []
        for i in range(pixels.shape[0]):
            digest = hashlib.blake2b(int(self.eval_seed).to_bytes(8, "little", signed=True), digest_size=8)
            for part in (pixels[i], text[i]):
                digest.update(part.flatten().view(torch.uint8).numpy().tobytes())
            seeds.append(int.from_bytes(digest.digest(), "little") >> 1)
        return seeds

    # -- throughput ------------------------------------------------------------------------------
    def flops_per_batch(self, batch) -> float:
        """UNet forward + backward FLOPs of a training batch, for Composer's SpeedMonitor, which turns
        them into `throughput/device/flops_per_sec` and, with the device's peak, `throughput/device/mfu`.

        Only the trained UNet counts (models/flops.py: matmuls, convolutions, attention), as in
        mosaicml/diffusion and MLPerf: not the frozen VAE encoder and text encoder forwards (which a
        run on precomputed latents skips, so MFU stays comparable between the two) nor gradient
        checkpointing's recomputation. Counted once per latent size and context length on the meta
        device from this UNet's config, then cached.
        """
        if "latents" in batch:
            n, _, height, width = batch["latents"].shape
        else:
            n, _, height, width = batch["image"].shape
            height, width = height // self.vae_scale_factor, width // self.vae_scale_factor
        context_length = (batch["text_embeds"] if "text_embeds" in batch else batch["input_ids"]).shape[1]
        return n * unet_training_flops(self.unet.config, height, width, context_length)

    def get_metrics(self, is_train: bool = False):
        return {} if is_train else {"MeanSquaredError": self.val_mse}

    def update_metric(self, batch, outputs, metric):
        metric.update(outputs[0].float().flatten(), outputs[1].float().flatten())

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
        if seeds is None:
            noise = torch.randn(shape, generator=torch.Generator().manual_seed(seed))
        elif len(seeds) != n:
            raise ValueError(f"give one seed per prompt: {len(seeds)} seeds for {n} prompts")
        else:
            draws = [torch.randn(shape[1:], generator=torch.Generator().manual_seed(s)) for s in seeds]
            noise = torch.stack(draws)
        latents = noise.to(device) * scheduler.init_noise_sigma
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


def in_dtype(condition: dict, dtype: torch.dtype) -> dict:
    """The denoiser's conditioning keywords with their embeddings in `dtype` (a no-op in fp32). Not
    SDXL's `time_ids`: sizes in pixels, which bf16 would round (1023 -> 1024); the UNet casts their
    sinusoidal embedding itself."""
    cast = {}
    for key, value in condition.items():
        if isinstance(value, dict):  # SDXL's added_cond_kwargs
            cast[key] = in_dtype(value, dtype)
        elif key == "time_ids" or not value.is_floating_point():
            cast[key] = value
        else:
            cast[key] = value.to(dtype)
    return cast
