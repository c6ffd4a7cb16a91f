"""The ComposerModel every family builds on: a trained denoiser over the latents of a frozen VAE,
conditioned on frozen text encoders, trained with an objective (models/engine/objectives.py).

Written once here: the training step's draws and call (`_diffuse`: the latent sample, caption
dropout, the objective's draws, the denoiser), the loss, caption dropout's mask, validation with
per-sample seeded draws (`eval_forward`, `eval_seeds`), the metric, the frozen parts' eval mode, the
initial noise of sampling, and FLOPs per batch. A family (models/families/sd/model.py,
models/families/sdxl/model.py, models/families/mmdit/model.py) adds what is its own: its networks, how latents
are scaled, its condition (`condition`, `prompt_condition`), how its denoiser is called (`denoise`),
and its sampling loop (`generate`). Its FLOPs are counted on that same path (models/flop_count.py).

A batch holds either images and token ids (`image` in [-1, 1], or uint8 as the data loader hands it
over: models/engine/pixels.py; `input_ids`, ...) or what `sd-convert latents` precomputed from them
(`latents`: the VAE's Gaussian moments, unscaled; `text_embeds`, ...). Both paths sample the latent
from the moments and scale it once, here, so the loss is the same for the same draws.

Training draws its latent samples, noise, timesteps and caption dropout from the global RNG (which
Composer seeds and checkpoints), or with `train_draws = "sample"` from generators keyed by the run's
seed, the batch index and each sample's index in its dataset (models/engine/draw_keys.py: the same draws on
any number of processes). Validation draws them from generators seeded per sample, so a
checkpoint's validation loss is the same number each time it is measured; with `eval_timesteps` each
sample's timestep is one of K fixed ones instead (MLPerf's rule: models/engine/eval_timesteps.py).
"""

import hashlib
import logging

import torch
from composer.models import ComposerModel
from torchmetrics import MeanSquaredError

from compat.diffusers import DiagonalGaussianDistribution
from models.engine.draw_keys import check_train_draws, draw_seeds, sample_indices
from models.engine.eval_timesteps import (
    STORED,
    STORED_LEVELS,
    FixedTimestepLoss,
    check_eval_timesteps,
    stored_or_seeded,
)
from models.engine.objectives import mse_per_sample
from models.engine.pixels import to_float
from models.engine.prior_loss import PRIOR, prior_preservation_loss
from models.flop_count import batch_columns, training_flops

log = logging.getLogger(__name__)


class LatentDiffusion(ComposerModel):
    """The shared model. Subclasses set `denoiser_name` and `frozen_names` (attribute names) and
    implement `scale_latents`, `condition` and `denoise`."""

    eval_seed: int = 0
    eval_timesteps: int | None = None  # K fixed validation timesteps (set_eval_timesteps), or random ones
    denoiser_name = "unet"  # the trained network's attribute: "unet" or "transformer"
    frozen_names: tuple[str, ...] = ("vae", "text_encoder")  # frozen parts, kept in eval mode
    train_draws = "rank"  # training's draws: "rank" (the global RNG) or "sample" (models/engine/draw_keys.py)
    # (run seed, batch index) for train_draws="sample": extensions/sample_draws.py sets it each batch.
    draw_key: tuple[int, int] | None = None
    # DreamBooth, for batches that flag class images (models/engine/prior_loss.py): their loss's weight,
    # and their share of every global batch (recipes/dreambooth.py batches half and half).
    prior_loss_weight: float = 1.0
    prior_share: float = 0.0

    def __init__(self, objective, caption_drop_prob: float = 0.0):
        super().__init__()
        if not 0.0 <= caption_drop_prob <= 1.0:
            raise ValueError(f"caption_drop_prob must be in [0, 1], not {caption_drop_prob}")
        self.objective = objective
        self.caption_drop_prob = caption_drop_prob
        self.val_mse = MeanSquaredError()
        self._empty_caption: dict[str, torch.Tensor] | None = None  # set_empty_caption's, on the CPU
        # The family's condition for the empty caption, per device (made from `empty_stored`); cleared
        # when the text encoders' weights or the empty caption change.
        self._empty: dict = {}
        self._sample_drop: torch.Tensor | None = None  # this step's per-sample caption dropout (_diffuse)
        self._warned_stored = False  # a set's stored eval timesteps ignored: said once

    def frozen_parts(self) -> list[torch.nn.Module]:
        return [m for m in (getattr(self, name, None) for name in self.frozen_names) if m is not None]

    def train(self, mode: bool = True):
        # Composer toggles train()/eval() on the whole model; the frozen parts must never leave eval.
        super().train(mode)
        for frozen in self.frozen_parts():
            frozen.eval()
        return self

    @property
    def denoiser(self) -> torch.nn.Module:
        """The trained network, whatever the family calls it (a UNet, a transformer): for code that
        handles every family (export, EMA, sharding checks)."""
        return getattr(self, self.denoiser_name)

    @property
    def denoiser_dtype(self) -> torch.dtype:
        """The dtype of the denoiser's weights: fp32, or bf16 with model.param_dtype (models/build.py).
        Its inputs are cast to it where the model calls it, so it runs outside autocast too (on the
        CPU, in sampling); its output is read back in fp32 (the loss, the sampler's steps)."""
        return next(self.denoiser.parameters()).dtype

    @property
    def vae_scale_factor(self) -> int:
        return 2 ** (len(self.vae.config.block_out_channels) - 1)

    # -- latents ---------------------------------------------------------------------------------
    @torch.no_grad()
    def vae_moments(self, images: torch.Tensor) -> torch.Tensor:
        """The VAE posterior's (mean, logvar), concatenated on channels: what `convert latents` stores.
        `images` in [-1, 1], or uint8 as the data loader hands them over (converted here, on their device)."""
        return self.vae.encode(to_float(images)).latent_dist.parameters

    def sample_latents(self, moments: torch.Tensor) -> torch.Tensor:
        return self.scale_latents(DiagonalGaussianDistribution(moments.float()).sample())

    def _drop_mask(self, n: int, device) -> torch.Tensor:
        """Which samples' captions caption dropout replaces by the empty caption's (training only)."""
        if not self.training or self.caption_drop_prob == 0.0:
            return torch.zeros(n, dtype=torch.bool, device=device)
        if self._sample_drop is not None:  # drawn per sample (train_draws="sample")
            return self._sample_drop
        return torch.rand(n, device=device) < self.caption_drop_prob

    def set_empty_caption(self, stored: dict[str, torch.Tensor] | None) -> None:
        """Take the empty caption's stored form from `stored` (what `sd-convert latents` wrote beside a
        precomputed set: data/latent_dataset.read_empty_caption) instead of encoding "" with the
        model's own text encoders, which a run on precomputed encodings otherwise loads for this alone
        (T5-XXL for Flux), and which need not be the encoders the set was made with. The same tensors
        as `encode` gives for "" (conditioner.encode, (1, ...) each, unrounded), so the loss is the
        one the model encoding "" computes. None: encode it again."""
        if stored is not None:
            known = {"text_embeds", "pooled_text_embeds", "text_embeds_3"}  # models/engine/conditioners.py
            if not stored or set(stored) - known:
                raise ValueError(
                    f"an empty caption's stored form holds some of {sorted(known)}, not {sorted(stored)}"
                )
            bad = [name for name, value in stored.items() if value.dim() < 2 or value.shape[0] != 1]
            if bad:
                shape = tuple(stored[bad[0]].shape)
                raise ValueError(f"the empty caption's {bad[0]} must be one caption's, (1, ...), not {shape}")
            stored = {name: value.detach().cpu() for name, value in stored.items()}
        self._empty_caption = stored
        self._empty.clear()

    def empty_stored(self, device) -> dict[str, torch.Tensor]:
        """The empty caption "" in the stored form (models/engine/conditioners.py: `text_embeds`, ...), (1,
        ...) each, on `device`: the precomputed set's (`set_empty_caption`), else encoded by the model's own
        text encoders. Each family turns it into its condition once per device (`self._empty`)."""
        if self._empty_caption is not None:
            return {name: value.to(device) for name, value in self._empty_caption.items()}
        ids = {name: value.to(device) for name, value in self.conditioner.ids(self, [""]).items()}
        return self.conditioner.encode(self, ids)

    def load_state_dict(self, state_dict, *args, **kwargs):
        self._empty.clear()  # the text encoders' weights may change
        return super().load_state_dict(_from_transformers_4(self, state_dict), *args, **kwargs)

    def caption_dropout(self, values: list[torch.Tensor], empty) -> list[torch.Tensor]:
        """`values` (a batch's condition tensors) with each sample's replaced, with probability
        caption_drop_prob in training, by the empty caption's (`empty()`: the same tensors for "",
        broadcast over the batch): one draw per sample for all of them. This trains the
        unconditional branch that classifier-free guidance needs."""
        n, device = values[0].shape[0], values[0].device
        drop = self._drop_mask(n, device)
        # No `if drop.any()`: that would wait for the GPU every step to save a few cheap where()s.
        return [
            torch.where(drop.view(n, *[1] * (v.dim() - 1)), e.to(v.dtype), v) for v, e in zip(values, empty())
        ]

    # -- training --------------------------------------------------------------------------------
    def forward(self, batch):
        return self._diffuse(batch)

    def set_train_draws(self, mode: str) -> None:
        """Training's draws from the global RNG ("rank", Composer seeds it seed + rank) or keyed per
        sample ("sample": models/engine/draw_keys.py)."""
        self.train_draws = check_train_draws(mode)

    def _diffuse(self, batch, seeds: list[int] | None = None):
        """(prediction, target, noise level) of the objective; the random draws come from the global
        RNG (the latent sample, caption dropout, then the objective's), or with `seeds` (one per
        sample, validation) from the objective's `seeded_draws`, with no caption dropout, or in
        training with train_draws="sample" from the same per-sample draws keyed by `draw_key` and
        each sample's index, caption dropout too."""
        moments = batch["latents"] if "latents" in batch else self.vae_moments(batch["image"])
        image_size = (moments.shape[-2] * self.vae_scale_factor, moments.shape[-1] * self.vae_scale_factor)
        if seeds is None and self.training and self.train_draws == "sample":
            return self._keyed_diffuse(batch, moments, image_size)
        if seeds is None:
            latents = self.sample_latents(moments)
            condition = self.condition(batch, True, image_size)
            draws = self.objective.draws(latents)
        else:
            levels = None
            if self.eval_timesteps is not None:
                levels = self.eval_levels[stored_or_seeded(batch, seeds, self.eval_timesteps)]
            elif STORED in batch and not self._warned_stored:
                self._warned_stored = True
                log.warning(
                    "the validation set stores a fixed timestep per sample (MLPerf's), which "
                    "model.eval_timesteps unset ignores: set model.eval_timesteps=%d to use them",
                    STORED_LEVELS,
                )
            latents, draws = self._seeded_latents(moments, seeds, levels)
            condition = self.condition(batch, False, image_size)
        return self.denoised(latents, draws, condition, image_size)

    def _keyed_diffuse(self, batch, moments, image_size):
        if self.draw_key is None:
            raise RuntimeError(
                "model.train_draws=sample draws from the run's seed and the batch index, which the "
                "trainer's extensions.sample_draws.SampleDraws callback sets; none has"
            )
        seeds, uniforms = draw_seeds(*self.draw_key, sample_indices(batch))
        latents, draws = self._seeded_latents(moments, seeds)
        self._sample_drop = torch.tensor(uniforms, device=moments.device) < self.caption_drop_prob
        try:
            condition = self.condition(batch, True, image_size)
        finally:
            self._sample_drop = None
        return self.denoised(latents, draws, condition, image_size)

    def _seeded_latents(self, moments, seeds, levels=None):
        """The scaled latent sample and the objective's draws, from one generator per sample."""
        posterior = DiagonalGaussianDistribution(moments.float())
        draws = self.objective.seeded_draws(seeds, posterior.mean.shape[1:], moments.device, levels)
        return self.scale_latents(posterior.mean + posterior.std * draws["latent"]), draws

    def denoised(self, latents, draws, condition, image_size):
        """(prediction, target, noise level): the objective's noisy latents and the denoiser's call on
        them, in the denoiser's dtype; the step's FLOPs are counted on it (models/flop_count.py)."""
        noisy, timesteps, target, level = self.objective.diffuse(latents, draws, image_size)
        dtype = self.denoiser_dtype
        prediction = self.denoise(noisy.to(dtype), timesteps, in_dtype(condition, dtype))
        return prediction, target, level

    def loss(self, outputs, batch):
        if PRIOR not in batch:
            return self.objective.loss(*outputs)
        # DreamBooth: instance mean + weight * class mean, as diffusers' script splits its batch.
        prediction, target, level = outputs
        per_sample = mse_per_sample(prediction, target)
        if (weight := self.objective.weight(level)) is not None:
            per_sample = per_sample * weight
        return prior_preservation_loss(per_sample, batch[PRIOR], self.prior_loss_weight, self.prior_share)

    # -- evaluation ------------------------------------------------------------------------------
    def eval_forward(self, batch, outputs=None):
        """Validation outputs: like `forward`, but the latent sample, noise and timestep of each sample
        come from a CPU generator seeded with `eval_seeds` (the eval seed and a hash of the sample's
        content), never from the global RNG, and no caption is dropped (even in train mode).

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

    def set_eval_timesteps(self, k: int | None) -> None:
        """Validate each sample at one of `k` evenly spaced timesteps, picked by its eval seed, and add
        the metric `FixedTimestepLoss` (the mean over them of each one's mean loss), as MLPerf's
        Flux benchmark (models/engine/eval_timesteps.py); None: at a seeded random timestep, as by default."""
        self.eval_timesteps = None if k is None else check_eval_timesteps(k)
        self.eval_levels = None if k is None else self.objective.fixed_levels(k)

    def get_metrics(self, is_train: bool = False):
        if is_train:
            return {}
        if self.eval_timesteps is None:
            return {"MeanSquaredError": self.val_mse}
        return {"MeanSquaredError": self.val_mse, "FixedTimestepLoss": FixedTimestepLoss(self.eval_levels)}

    def update_metric(self, batch, outputs, metric):
        if isinstance(metric, FixedTimestepLoss):
            metric.update(*outputs)
        else:
            metric.update(outputs[0].float().flatten(), outputs[1].float().flatten())

    # -- throughput ------------------------------------------------------------------------------
    def flops_per_batch(self, batch) -> float:
        """Denoiser forward + backward FLOPs of a training batch, for Composer's SpeedMonitor, which
        turns them into `throughput/device/flops_per_sec` and, with the device's peak,
        `throughput/device/mfu`.

        Only the trained denoiser counts (models/flops.py), as in mosaicml/diffusion and MLPerf: not
        the frozen VAE encoder and text encoder forwards (which a run on precomputed latents skips, so
        MFU stays comparable between the two) nor gradient checkpointing's recomputation. Counted on
        this model's own step with the batch's shapes (models/flop_count.py), once per latent size and
        text columns.
        """
        if "latents" in batch:
            n, _, height, width = batch["latents"].shape
        else:
            n, _, height, width = batch["image"].shape
            height, width = height // self.vae_scale_factor, width // self.vae_scale_factor
        return n * training_flops(self, height, width, batch_columns(batch))

    # -- sampling --------------------------------------------------------------------------------
    @staticmethod
    def initial_noise(shape: tuple[int, ...], seed: int = 0, seeds: list[int] | None = None) -> torch.Tensor:
        """Sampling's starting noise on the CPU: from one generator seeded with `seed`, so the same seed
        gives the same image on any device, or with `seeds` one generator per image, so an image does
        not depend on which others share its batch."""
        if seeds is None:
            return torch.randn(shape, generator=torch.Generator().manual_seed(seed))
        if len(seeds) != shape[0]:
            raise ValueError(f"give one seed per prompt: {len(seeds)} seeds for {shape[0]} prompts")
        draws = [torch.randn(shape[1:], generator=torch.Generator().manual_seed(s)) for s in seeds]
        return torch.stack(draws)


def in_dtype(condition: dict, dtype: torch.dtype) -> dict:
    """The denoiser's conditioning keywords with their embeddings in `dtype` (a no-op in fp32). Not
    SDXL's `time_ids`: sizes in pixels, which bf16 would round (1023 -> 1024); the UNet casts their
    sinusoidal embedding itself."""
    cast = {}
    for key, value in condition.items():
        if isinstance(value, dict):  # SDXL's added_cond_kwargs
            cast[key] = in_dtype(value, dtype)
        elif isinstance(value, list):  # one tensor per sample (Z-Image's unpadded captions)
            cast[key] = [v.to(dtype) if v.is_floating_point() else v for v in value]
        elif key == "time_ids" or not value.is_floating_point():
            cast[key] = value
        else:
            cast[key] = value.to(dtype)
    return cast


def _from_transformers_4(model: torch.nn.Module, state_dict: dict) -> dict:
    """`state_dict` with a transformers 4 CLIPTextModel's keys (`text_encoder.text_model.embeddings...`,
    in every checkpoint written before our move to transformers 5) renamed to transformers 5's, which
    dropped the `text_model.` level of that class (not of CLIPTextModelWithProjection's): so a run
    started on the old stack resumes, exports and generates on the new one."""
    from transformers import CLIPTextModel

    renames = [f"{name}.text_model." for name, part in model.named_children() if type(part) is CLIPTextModel]
    if not any(key.startswith(tuple(renames)) for key in state_dict):
        return state_dict
    renamed = {}
    for key, value in state_dict.items():
        old = next((prefix for prefix in renames if key.startswith(prefix)), None)
        renamed[key.replace(".text_model.", ".", 1) if old else key] = value
    return renamed
