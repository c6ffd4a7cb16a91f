"""What the rectified-flow transformer families share beyond the shared model
(models/engine/latent_diffusion.py): SD3's MMDiT (models/families/mmdit/model.py) and Flux.1
(models/families/flux/model.py) both train a `transformer` with models/engine/objectives.py's RectifiedFlow on
x0 = (a sample of the VAE posterior - latent_shift) * latent_scale, beside a frozen VAE and frozen text
encoders, and sample with the objective's Euler sampler at the shift training used. Here: the objective and
its options as model attributes, the frozen parts' set-up (eval mode, no gradients, not sharded), the latent
scale and shift as buffers, latent scaling and the sampler. Each family adds its encoders' checks, its
condition, its denoiser call and its sampling loop.
"""

import torch
from diffusers import FlowMatchEulerDiscreteScheduler

from models.engine.latent_diffusion import LatentDiffusion
from models.engine.objectives import FlowOptions, RectifiedFlow, forwarded


class FlowTransformer(LatentDiffusion):
    """A LatentDiffusion over a rectified-flow `transformer`. Subclasses call `set_parts` in their
    constructor, once they have checked that the parts fit together."""

    denoiser_name = "transformer"
    micro_conditioning = False  # no SDXL size conditioning: the data loader hands over no sizes
    prediction_type = "flow_prediction"  # diffusers' name for the velocity target, noise - x0
    zero_terminal_snr = False
    default_guidance_rescale = 0.0

    # The objective's options, which code and tests read (and set) on the model.
    noise_scheduler = forwarded("scheduler")
    timestep_mean = forwarded("timestep_mean")
    timestep_std = forwarded("timestep_std")
    timestep_shift = forwarded("timestep_shift")
    loss_weighting = forwarded("loss_weighting")
    timestep_density = forwarded("timestep_density")

    def __init__(self, noise_scheduler: FlowMatchEulerDiscreteScheduler, caption_drop_prob=0.0, **objective):
        """`objective`: FlowOptions' fields (models/engine/objectives.py), as the model records and the
        YAML's `model:` keys name them; an unknown one is a TypeError naming it."""
        super().__init__(RectifiedFlow(noise_scheduler, FlowOptions(**objective)), caption_drop_prob)

    def set_parts(
        self, transformer, vae, encoders: dict, tokenizers: dict, latent_scale, latent_shift, t5_tokens: int
    ) -> None:
        """The trained transformer, the frozen VAE and text encoders (name -> module or None, in eval
        mode without gradients), the tokenizers (name -> tokenizer or None), and the latent scale and
        shift as buffers, so checkpoints carry them (a VAE trained here has its own:
        models/autoencoder.py). Only the transformer is sharded: the frozen parts have no gradients
        or optimizer state."""
        self.transformer = transformer
        self.vae = vae.requires_grad_(False).eval()
        for name, encoder in encoders.items():
            setattr(self, name, None if encoder is None else encoder.requires_grad_(False).eval())
        for name, tokenizer in tokenizers.items():
            setattr(self, name, tokenizer)
        self.register_buffer("latent_scale", torch.tensor(float(latent_scale)))
        self.register_buffer("latent_shift", torch.tensor(float(latent_shift or 0.0)))
        self.t5_tokens = int(t5_tokens)
        self.transformer._fsdp_wrap = True
        for frozen in (self.vae, *encoders.values()):
            if frozen is not None:
                frozen._fsdp_wrap = False

    # -- latents ---------------------------------------------------------------------------------
    def scale_latents(self, sample: torch.Tensor) -> torch.Tensor:
        """A VAE latent sample -> what the transformer models: (sample - shift) * scale."""
        return (sample - self.latent_shift) * self.latent_scale

    def unscale_latents(self, latents: torch.Tensor) -> torch.Tensor:
        """The inverse, what the VAE decodes: latents / scale + shift (as the SD3 and Flux pipelines
        decode)."""
        return latents / self.latent_scale + self.latent_shift

    # -- timesteps and sampling ------------------------------------------------------------------
    def shift_for(self, image_size: tuple[int, int]) -> float:
        """The timestep shift for images of `image_size` (height, width) pixels, in training and in
        sampling alike (RectifiedFlow.shift_for)."""
        return self.objective.shift_for(image_size)

    def sample_timesteps(self, normal: torch.Tensor, image_size: tuple[int, int]) -> torch.Tensor:
        """Noise levels t in (0, 1) from standard normal draws: logit-normal (or uniform), shifted."""
        return self.objective.sample_timesteps(normal, image_size)

    def sampling_scheduler(self, image_size: tuple[int, int]) -> FlowMatchEulerDiscreteScheduler:
        """The Euler sampler for images of `image_size` (height, width): the noise scheduler's config
        with `shift_for(image_size)`, so sampling shifts as training did (an export writes it at
        `native_size()`)."""
        return self.objective.sampler(image_size)

    def sampling_size(self, sampler, guidance_rescale, height, width, multiple: int) -> tuple[int, int]:
        """`generate`'s (height, width): the native size's where not given, each a multiple of
        `multiple` (the VAE's factor x the patch size); and the DDPM samplers' options refused: a flow
        samples with Euler steps alone ("euler" or None), with no guidance rescale (0 or None)."""
        if sampler not in (None, "euler"):
            raise ValueError(
                f"sampler={sampler!r}: a flow model samples with flow-matching Euler steps ('euler')"
            )
        if guidance_rescale:
            raise ValueError(
                "guidance_rescale is not an option of flow sampling (the SD3 and Flux pipelines have none)"
            )
        height, width = height or self.native_size()[0], width or self.native_size()[1]
        if height % multiple or width % multiple:
            raise ValueError(f"height and width must be multiples of {multiple}, got {height} x {width}")
        return height, width

    def euler_steps(self, scheduler, latents: torch.Tensor, velocity) -> torch.Tensor:
        """The flow pipelines' sampling loop: at each of `scheduler`'s timesteps t an Euler step with
        `velocity(latents, t)`, the transformer in eval mode meanwhile. `velocity` is the family's
        guided call, as its pipeline makes it: the order of the guided sum and the batching change the
        last bits, which an export must reproduce (SD3: one call on [uncond, cond]; FLUX.1: a second
        call; Z-Image: one call on [cond, uncond], cond + g (cond - uncond))."""
        was_training = self.transformer.training
        self.transformer.eval()
        try:
            for t in scheduler.timesteps:
                latents = scheduler.step(velocity(latents, t), t, latents).prev_sample
        finally:
            self.transformer.train(was_training)
        return latents

    def to_images(self, latents: torch.Tensor) -> torch.Tensor:
        """Sampled latents -> images (B, 3, H, W) in [0, 1], decoded as the pipelines decode."""
        images = self.vae.decode(self.unscale_latents(latents).to(self.vae.dtype)).sample
        return (images.float() / 2 + 0.5).clamp(0, 1)
