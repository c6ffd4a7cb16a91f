"""Training FLOPs of any family's model, counted on the model's own training path: one forward +
backward of the denoiser as the training step calls it (the model's `condition`, then `denoised`
with the objective's draws, then its `loss`), on meta-device inputs, under torch's FlopCounterMode
(matmuls, convolutions, attention). Nothing here knows a family: a new one is counted as its model
class is written, latent packing, joint contexts and micro-conditioning included.

`step_flops(model, ...)` counts a model whose networks are already on the meta device (models/flops.py
builds a preset's); `training_flops(model, ...)` counts a live one on a meta copy of it (`meta_copy`),
cached per model and shapes: what the models' `flops_per_batch` calls every batch.
"""

import copy
import logging
import weakref
from collections.abc import Callable

import torch
from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel
from torch.utils.flop_counter import FlopCounterMode
from transformers import PreTrainedModel

from compat.torch import meta_selects_all

log = logging.getLogger(__name__)

_BATCH = 2  # count a batch of 2 and divide, so no per-batch-of-1 shortcut can skew the count
PIXELS = ("image", "latents")  # a batch's images or VAE moments: the latents' size is given instead

# The columns of the text a batch holds, (name, per-sample shape, dtype) each, sorted by name: token
# ids, or the stored form that `sd-convert latents` wrote (models/engine/conditioners.py).
Columns = tuple[tuple[str, tuple[int, ...], torch.dtype], ...]

# model -> {(height, width, columns): FLOPs per sample}; weak, so a finished run's model is freed.
_COUNTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _count(fn) -> int:
    counter = FlopCounterMode(display=False)
    with counter:
        fn()
    return counter.get_total_flops()


def batch_columns(batch: dict) -> Columns:
    """The per-sample shapes and dtypes of `batch`'s tensors besides its images or latents: whatever
    the model's `condition` reads (token ids, stored embeddings, SDXL's sizes)."""
    return tuple(
        sorted(
            (name, tuple(value.shape[1:]), value.dtype)
            for name, value in batch.items()
            if isinstance(value, torch.Tensor) and name not in PIXELS
        )
    )


def token_columns(model) -> Columns:
    """The token ids the model's conditioner reads, at the lengths it reads them (CLIP's 77, the
    model's T5 or LLM length): a batch of captions, as the data loader hands it over."""
    lengths = model.conditioner.id_lengths(model)
    return tuple(sorted((name, (n,), torch.long) for name, n in lengths.items()))


def training_step(
    model, height: int, width: int, columns: Columns | None = None, n: int = _BATCH
) -> Callable:
    """The training step's denoiser forward + backward for `n` samples of height x width latents and
    text `columns` (None: `token_columns`), as a function of no arguments, for a model whose networks
    are on the meta device. The condition is made first, outside it: from token ids the frozen text
    encoders run, which MFU leaves out (models/flops.py); caption dropout only picks between two
    conditions of the same shapes, so none is drawn. A selection by value (a caption's real tokens out
    of its padded ones) keeps every element: the longest case, the one the meta device can count."""
    with torch.device("meta"):
        batch = {
            name: torch.zeros(n, *shape, dtype=dtype)
            for name, shape, dtype in columns or token_columns(model)
        }
        latents = torch.randn(n, model.vae.config.latent_channels, height, width)
    image_size = (height * model.vae_scale_factor, width * model.vae_scale_factor)
    with meta_selects_all():
        condition = model.condition(batch, False, image_size)

    def step():
        with meta_selects_all():
            outputs = model.denoised(latents, model.objective.draws(latents), condition, image_size)
            model.loss(outputs, batch).backward()

    return step


def step_flops(model, height: int, width: int, columns: Columns | None = None) -> float:
    """FLOPs of one training forward + backward per sample of height x width latents (`training_step`),
    for a model whose networks are on the meta device."""
    return _count(training_step(model, height, width, columns)) / _BATCH


def training_flops(model, height: int, width: int, columns: Columns | None = None) -> float:
    """`step_flops` of any model, its networks anywhere (a training run's, sharded or not), counted on
    `meta_copy(model)` once per latent size and text columns, then cached for that model."""
    counts = _COUNTS.setdefault(model, {})
    key = (int(height), int(width), columns or token_columns(model))
    if key not in counts:
        counts[key] = step_flops(meta_copy(model), *key)
        log.info(
            "%s at %dx%d latents: %.4g training FLOP per sample", type(model).__name__, *key[:2], counts[key]
        )
    return counts[key]


def meta_copy(model):
    """`model` with each of its networks built again on the meta device from its class and config (no
    weights, no memory) and its own copy of the objective (DDPM's add_noise moves the scheduler's
    tables to the noise's device); its other attributes (options, tokenizers) are `model`'s.

    A shallow copy rather than the model class called anew: the class's keywords are its family's, and
    nothing at this layer knows families (models/registry.py is above the models that count here)."""
    twin = copy.copy(model)
    twin._modules = {name: _on_meta(child) for name, child in model._modules.items()}
    twin.objective = copy.deepcopy(model.objective)
    return twin


def _on_meta(module: torch.nn.Module | None) -> torch.nn.Module | None:
    """A diffusers or transformers network (what has a `config`) built again on the meta device; any
    other module (a metric) as it is. Under FSDP the class is the network's own: FSDP1 wraps it
    (`.module`), FSDP2's fully_shard swaps its class for a subclass of FSDPModule and it."""
    if getattr(module, "config", None) is None:
        return module
    if isinstance(module, FullyShardedDataParallel):
        module = module.module
    cls = next(c for c in type(module).__mro__ if not issubclass(c, FSDPModule))
    with torch.device("meta"):
        if isinstance(module, PreTrainedModel):
            return cls(copy.deepcopy(module.config))
        return cls.from_config(module.config)
