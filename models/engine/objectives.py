"""Training objectives, apart from the networks (as DiT's `diffusion/` keeps schedules, losses and
samplers apart from its model): `DDPM` (StableDiffusion, SDXL) and `RectifiedFlow` (the MMDiT).

An objective turns clean latents x0 and its random draws into what the denoiser is trained on:
    draws = objective.draws(x0)                          # training: from the global RNG
    draws = objective.seeded_draws(seeds, shape, device) # validation: one generator per sample,
                                                         # with the posterior's `latent` normal too;
                                                         # `levels`: fixed timesteps (eval_timesteps)
    noisy, timesteps, target, level = objective.diffuse(x0, draws, image_size)
    prediction = denoiser(noisy, timesteps, ...)
    loss = objective.loss(prediction, target, level)     # per-sample MSE x the objective's weight
and gives the diffusers scheduler that samples (and is exported) with what it trained. The models
hold one as `model.objective`; their objective attributes (noise_scheduler, prediction_type, ...)
forward to it.

The draws are made in a fixed order from a fixed RNG (the model's latent sample and caption dropout
before them in training), so a run's numbers do not depend on how this code is arranged.
"""

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from diffusers import (
    DDIMScheduler,
    DPMSolverMultistepScheduler,
    EulerDiscreteScheduler,
    FlowMatchEulerDiscreteScheduler,
)

SAMPLERS = {  # DDPM's samplers, by the name `generate` and the sample grids take
    "ddim": DDIMScheduler,
    "euler": EulerDiscreteScheduler,
    "dpm++": DPMSolverMultistepScheduler,
}
LOSS_WEIGHTINGS = (None, "sigma_sqrt", "cosmap")
# Rectified flow's timestep densities, the default first: SD3's logit-normal, or uniform on (0, 1),
# the MLPerf Flux.1 reference's (mlcommons/training text_to_image, torchtitan branch
# mlperf-training-flux.1, torchtitan/experiments/flux/train.py: `timesteps = torch.rand((bsz,))`,
# no shift; torchtitan's models/flux/trainer.py draws them the same way).
TIMESTEP_DENSITIES = ("logit_normal", "uniform")
BASE_PIXELS = 256 * 256  # the resolution `timestep_shift: auto` shifts relative to (SD3's eq. 23 n)


def forwarded(name: str, settable: bool = True) -> property:
    """A model attribute that reads (and sets) `model.objective.<name>`: the objective's options keep
    their names on the model, which code and tests read."""
    setter = (lambda model, value: setattr(model.objective, name, value)) if settable else None
    return property(lambda model: getattr(model.objective, name), setter)


class Noised(NamedTuple):
    noisy: torch.Tensor  # the denoiser's input x_t
    timesteps: torch.Tensor  # the timestep the denoiser takes
    target: torch.Tensor
    level: torch.Tensor  # what `loss` weights by: DDPM's timestep, the flow's t in (0, 1)


def mse_per_sample(prediction: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(prediction.float(), target.float(), reduction="none").mean(dim=(1, 2, 3))


def _per_sample(seeds: list[int], device, draw) -> dict[str, torch.Tensor]:
    """`draw(generator)` -> {name: tensor} per seed, from a CPU generator seeded with it (so the same
    on any device, and a sample's draws do not depend on its batch), stacked and moved to `device`."""
    samples = [draw(torch.Generator().manual_seed(seed)) for seed in seeds]
    return {name: torch.stack([s[name] for s in samples]).to(device) for name in samples[0]}


def seeded_draws(seeds: list[int], latent_shape, num_timesteps: int, device) -> dict[str, torch.Tensor]:
    """DDPM's validation draws per sample: the posterior's standard normal `latent`, the `noise`, a
    timestep and the per-channel `offset` noise, in that order (the offset last, so offset_noise
    leaves the others unchanged). A dict literal evaluates left to right: that is the order."""
    return _per_sample(
        seeds,
        device,
        lambda g: {
            "latent": torch.randn(latent_shape, generator=g),
            "noise": torch.randn(latent_shape, generator=g),
            "timesteps": torch.randint(0, num_timesteps, (), generator=g),
            "offset": torch.randn(latent_shape[0], 1, 1, generator=g),
        },
    )


def seeded_flow_draws(seeds: list[int], latent_shape, device) -> dict[str, torch.Tensor]:
    """Rectified flow's validation draws per sample: the posterior's standard normal `latent`, the
    `noise`, and the standard normal `normal` the logit-normal timestep is made of, in that order."""
    return _per_sample(
        seeds,
        device,
        lambda g: {
            "latent": torch.randn(latent_shape, generator=g),
            "noise": torch.randn(latent_shape, generator=g),
            "normal": torch.randn((), generator=g),
        },
    )


class DDPM:
    """Denoising diffusion over a diffusers DDPM-family `noise_scheduler` (its betas, and with
    `rescale_betas_zero_snr` Lin et al. 2023's zero terminal SNR, come from it):
        x_t = sqrt(a_t) x0 + sqrt(1 - a_t) noise,  t uniform in 0 .. num_train_timesteps - 1,
        target = noise ("epsilon", SD2 base) or sqrt(a_t) noise - sqrt(1 - a_t) x0 ("v_prediction").
    offset_noise adds offset_noise * N(0, 1) per (sample, channel) to the noise, which lets the model
    shift an image's mean brightness (Guttenberg 2023; 0.1 is usual). min_snr_gamma weights each
    sample by min(SNR, gamma) / SNR (epsilon) or min(SNR, gamma) / (SNR + 1) (v), SNR = a_t / (1 - a_t)
    (Hang et al. 2023, "Efficient Diffusion Training via Min-SNR Weighting Strategy"; 5.0 is usual).
    """

    def __init__(
        self,
        noise_scheduler,
        prediction_type: str = "epsilon",
        offset_noise: float = 0.0,
        min_snr_gamma: float | None = None,
    ):
        if prediction_type not in ("epsilon", "v_prediction"):
            raise ValueError(f"prediction_type must be 'epsilon' or 'v_prediction', not {prediction_type!r}")
        if prediction_type == "epsilon" and float(noise_scheduler.alphas_cumprod[-1]) == 0.0:
            # A schedule rescaled to zero terminal SNR, e.g. a loaded scheduler with
            # rescale_betas_zero_snr: x0 = (x_t - sigma * eps) / alpha is undefined at alpha = 0, and
            # the min-SNR weight min(SNR, gamma) / SNR is 0 / 0.
            raise ValueError(
                "the noise schedule ends at zero SNR (rescale_betas_zero_snr), where epsilon is undefined; "
                "use prediction_type=v_prediction"
            )
        # Rebuilt rather than `register_to_config(prediction_type=...)`: that leaves the key in the
        # config's `_use_default_values`, so another class's from_config (the exported DDIM sampler)
        # silently drops it and predicts epsilon.
        scheduler_class = type(noise_scheduler)
        self.scheduler = scheduler_class.from_config(noise_scheduler.config, prediction_type=prediction_type)
        self.prediction_type = prediction_type
        self.offset_noise = offset_noise
        self.min_snr_gamma = min_snr_gamma

    @property
    def zero_terminal_snr(self) -> bool:
        return bool(self.scheduler.config.get("rescale_betas_zero_snr", False))

    def draws(self, latents: torch.Tensor) -> dict[str, torch.Tensor]:
        """Training's draws from the global RNG: noise, the offset noise (with offset_noise only), the
        timesteps. Not randn_like: that follows the latents' memory format, channels-last when a CPU VAE
        encoded a batch, so the same draws would land elsewhere than on stored latents."""
        draws = {"noise": torch.randn(latents.shape, device=latents.device, dtype=latents.dtype)}
        if self.offset_noise:
            draws["offset"] = torch.randn(*latents.shape[:2], 1, 1, device=latents.device)
        steps = self.scheduler.config.num_train_timesteps
        draws["timesteps"] = torch.randint(0, steps, (latents.shape[0],), device=latents.device)
        return draws

    def seeded_draws(self, seeds: list[int], latent_shape, device, levels=None) -> dict[str, torch.Tensor]:
        """Validation's draws; with `levels` (one of `fixed_levels` per sample) those timesteps in place
        of the drawn ones, which are still drawn, so the noise is the same either way."""
        draws = seeded_draws(seeds, latent_shape, self.scheduler.config.num_train_timesteps, device)
        if levels is not None:
            draws["timesteps"] = levels.to(device)
        return draws

    def fixed_levels(self, k: int) -> torch.Tensor:
        """K evenly spaced timesteps floor(i T / K), i = 0 .. K - 1, T the training timesteps
        (models/engine/eval_timesteps.py: MLPerf's t = i / K on this schedule)."""
        steps = self.scheduler.config.num_train_timesteps
        if k > steps:
            raise ValueError(f"model.eval_timesteps={k} is more than the schedule's {steps} timesteps")
        return torch.arange(k) * steps // k

    def diffuse(self, latents: torch.Tensor, draws: dict, image_size=None) -> Noised:
        noise, timesteps = draws["noise"], draws["timesteps"]
        if self.offset_noise:
            noise = noise + self.offset_noise * draws["offset"]
        noisy = self.scheduler.add_noise(latents, noise, timesteps)
        if self.prediction_type == "epsilon":
            target = noise
        else:
            target = self.scheduler.get_velocity(latents, noise, timesteps)
        return Noised(noisy, timesteps, target, timesteps)

    def snr(self, timesteps: torch.Tensor) -> torch.Tensor:
        alphas = self.scheduler.alphas_cumprod.to(timesteps.device)[timesteps]
        return alphas / (1 - alphas)

    def weight(self, timesteps: torch.Tensor) -> torch.Tensor | None:
        """Per-sample min-SNR loss weights, or None (unweighted)."""
        if self.min_snr_gamma is None:
            return None
        snr = self.snr(timesteps)
        weight = snr.clamp(max=self.min_snr_gamma)
        return weight / snr if self.prediction_type == "epsilon" else weight / (snr + 1)

    def loss(self, prediction: torch.Tensor, target: torch.Tensor, timesteps: torch.Tensor) -> torch.Tensor:
        per_sample = mse_per_sample(prediction, target)
        weight = self.weight(timesteps)
        return per_sample.mean() if weight is None else (per_sample * weight).mean()

    def sampler(self, name: str = "ddim"):
        """A sampler of SAMPLERS on this schedule (betas, prediction type, spacing)."""
        if name not in SAMPLERS:
            raise ValueError(f"unknown sampler {name!r}; choose one of {sorted(SAMPLERS)}")
        return SAMPLERS[name].from_config(self.scheduler.config)


def shift_timesteps(t: torch.Tensor, shift: float) -> torch.Tensor:
    """s t / (1 + (s - 1) t): SD3's eq. 23, and FlowMatchEulerDiscreteScheduler's `shift`."""
    return shift * t / (1 + (shift - 1) * t)


def resolution_shift(height: int, width: int) -> float:
    """sqrt(pixels / 256^2): the shift that keeps an image of height x width pixels as uncertain at a
    timestep as a 256 px one (eq. 23 with n = 256^2)."""
    return math.sqrt(height * width / BASE_PIXELS)


def loss_weights(t: torch.Tensor, weighting: str | None) -> torch.Tensor:
    """Per-sample loss weights at noise levels `t`, as diffusers' compute_loss_weighting_for_sd3."""
    if weighting is None:
        return torch.ones_like(t)
    if weighting == "sigma_sqrt":
        return t**-2.0
    if weighting == "cosmap":
        return 2 / (math.pi * (1 - 2 * t + 2 * t**2))
    raise ValueError(f"loss_weighting={weighting!r}; choose one of {LOSS_WEIGHTINGS}")


@dataclass(frozen=True)
class FlowOptions:
    """Rectified flow's options, under the names the YAML's `model:` keys and the model records give
    them (models/engine/family.py FLOW_OPTIONS reads the defaults here): the one object the flow models
    hand their objective. What each does: RectifiedFlow's docstring. Checked when made."""

    timestep_mean: float = 0.0
    timestep_std: float = 1.0
    timestep_shift: float | str | None = None  # None: the noise scheduler's shift
    loss_weighting: str | None = None
    timestep_density: str | None = None  # None: the preset's, else TIMESTEP_DENSITIES[0]

    def __post_init__(self):
        density = self.timestep_density or TIMESTEP_DENSITIES[0]
        if density not in TIMESTEP_DENSITIES:
            raise ValueError(f"timestep_density={density!r}; choose one of {TIMESTEP_DENSITIES}")
        if density == "uniform" and (self.timestep_mean, self.timestep_std) != (0.0, 1.0):
            raise ValueError(
                "timestep_mean and timestep_std shape the logit-normal density; timestep_density=uniform "
                "takes neither"
            )
        if not self.timestep_std > 0:
            raise ValueError(f"timestep_std must be positive, not {self.timestep_std}")
        shift = self.timestep_shift
        if shift not in (None, "auto") and (isinstance(shift, bool | str) or not float(shift) > 0):
            raise ValueError(
                f"timestep_shift must be None (the scheduler's), a positive number or 'auto', not {shift!r}"
            )
        if self.loss_weighting not in LOSS_WEIGHTINGS:
            raise ValueError(f"loss_weighting={self.loss_weighting!r}; choose one of {LOSS_WEIGHTINGS}")


class RectifiedFlow:
    """Rectified flow as SD3 trains it (Esser et al. 2024, "Scaling Rectified Flow Transformers for
    High-Resolution Image Synthesis", sections 2 and 3.1):
        t = s u / (1 + (s - 1) u),  u = sigmoid(timestep_mean + timestep_std * n),  n ~ N(0, 1)
        x_t = (1 - t) x0 + t noise,  the denoiser gets timestep num_train_timesteps x t (1000 t),
        target = noise - x0 (the velocity dx_t/dt),  loss weight w(t).
    The timesteps are logit-normal (eq. 19; SD3's m = 0, s = 1 puts more samples in the middle of the
    path, where the velocity is hardest to predict), then shifted by s (eq. 23): s > 1 moves them
    towards noise, which a higher resolution needs since its pixels are more redundant. With
    `timestep_density="uniform"` (the MLPerf Flux.1 reference's, TIMESTEP_DENSITIES) u is uniform on
    (0, 1) instead: u = Phi(n), the standard normal's CDF of the same draw, so training and validation
    draw the same numbers whichever the density (timestep_mean and timestep_std do not apply). 1000 t is
    diffusers' SD3 convention (sigmas x num_train_timesteps), what the pipeline's sampler passes.

    One shift for training and sampling (`shift_for`): the sampler's sigmas are eq. 23 applied to a
    uniform grid (FlowMatchEulerDiscreteScheduler's `shift`). `timestep_shift` None takes the noise
    scheduler's `shift` (a loaded SD3's 3.0, a preset's); a number is that shift; "auto" is the paper's
    sqrt(m / n), m the image's pixels, n = 256^2 (1 at 256 px, 4 at 1024 px).
    `loss_weighting`: None (SD3's: the logit-normal density already weights), or diffusers'
    "sigma_sqrt" (w = t^-2) or "cosmap" (w = 2 / (pi (1 - 2t + 2t^2))), as its SD3 training script.
    """

    prediction_type = "flow_prediction"  # diffusers' name for the velocity target, noise - x0
    zero_terminal_snr = False

    def __init__(self, noise_scheduler: FlowMatchEulerDiscreteScheduler, options: FlowOptions | None = None):
        options = options or FlowOptions()
        if not isinstance(noise_scheduler, FlowMatchEulerDiscreteScheduler):
            raise TypeError(
                "a flow model samples with FlowMatchEulerDiscreteScheduler, not "
                f"{type(noise_scheduler).__name__}"
            )
        if noise_scheduler.config.get("use_dynamic_shifting"):
            raise ValueError(
                "a scheduler with use_dynamic_shifting (Flux's) is not supported: give it a fixed shift"
            )
        self.scheduler = noise_scheduler
        # Attributes rather than `self.options`: the models forward them and tests set them one by one.
        self.timestep_mean, self.timestep_std = float(options.timestep_mean), float(options.timestep_std)
        shift = options.timestep_shift
        self.timestep_shift = shift if shift in (None, "auto") else float(shift)
        self.loss_weighting = options.loss_weighting
        self.timestep_density = options.timestep_density or TIMESTEP_DENSITIES[0]

    def shift_for(self, image_size: tuple[int, int]) -> float:
        """The timestep shift for images of `image_size` (height, width) pixels, in training and in
        sampling alike."""
        if self.timestep_shift is None:
            return float(self.scheduler.config.shift)
        if self.timestep_shift == "auto":
            return resolution_shift(*image_size)
        return self.timestep_shift

    def sample_timesteps(self, normal: torch.Tensor, image_size: tuple[int, int]) -> torch.Tensor:
        """Noise levels t in (0, 1) from standard normal draws: logit-normal (or uniform), then shifted."""
        if self.timestep_density == "uniform":
            t = torch.special.ndtr(normal.float())  # Phi(n): uniform on (0, 1) for n ~ N(0, 1)
        else:
            t = torch.sigmoid(self.timestep_mean + self.timestep_std * normal.float())
        return shift_timesteps(t, self.shift_for(image_size))

    def draws(self, latents: torch.Tensor) -> dict[str, torch.Tensor]:
        """Training's draws from the global RNG: the noise, then the timesteps' normal draws."""
        return {
            "noise": torch.randn(latents.shape, device=latents.device, dtype=latents.dtype),
            "normal": torch.randn(latents.shape[0], device=latents.device),
        }

    def seeded_draws(self, seeds: list[int], latent_shape, device, levels=None) -> dict[str, torch.Tensor]:
        """Validation's draws; with `levels` (one of `fixed_levels` per sample) those noise levels `t`,
        used as they are (neither logit-normal nor shifted), the same noise either way."""
        draws = seeded_flow_draws(seeds, latent_shape, device)
        if levels is not None:
            draws["t"] = levels.to(device)
        return draws

    def fixed_levels(self, k: int) -> torch.Tensor:
        """K evenly spaced noise levels t = i / K, i = 0 .. K - 1: MLPerf's Flux validation timesteps
        [0, 7/8] for K = 8 (models/engine/eval_timesteps.py)."""
        return torch.arange(k, dtype=torch.float32) / k

    def diffuse(self, latents: torch.Tensor, draws: dict, image_size: tuple[int, int]) -> Noised:
        noise = draws["noise"]
        t = draws["t"] if "t" in draws else self.sample_timesteps(draws["normal"], image_size)
        sigma = t[:, None, None, None]
        noisy = (1 - sigma) * latents + sigma * noise
        return Noised(noisy, t * self.scheduler.config.num_train_timesteps, noise - latents, t)

    def weight(self, t: torch.Tensor) -> torch.Tensor | None:
        return None if self.loss_weighting is None else loss_weights(t.float(), self.loss_weighting)

    def loss(self, prediction: torch.Tensor, target: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        per_sample = mse_per_sample(prediction, target)
        weight = self.weight(t)
        return per_sample.mean() if weight is None else (per_sample * weight).mean()

    def sampler(self, image_size: tuple[int, int]) -> FlowMatchEulerDiscreteScheduler:
        """The Euler sampler for images of `image_size` (height, width): the noise scheduler's config
        with `shift_for(image_size)`, so sampling shifts as training did."""
        shift = self.shift_for(image_size)
        return FlowMatchEulerDiscreteScheduler.from_config(self.scheduler.config, shift=shift)
