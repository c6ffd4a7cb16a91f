"""A memory-efficient exponential moving average of the trainable weights, as a Composer Algorithm.

Why not `composer.algorithms.EMA`: it also copies every buffer, updates with
`e.copy_(e * s + p * (1 - s))` (three temporaries per parameter) and swaps weights through a full
clone. Here:
- only parameters with `requires_grad` are tracked (the frozen VAE and text encoder never are);
- the average is one copy of them, fp32 by default (bf16 storage and CPU offload optional), and
  under FSDP it is built from `model.parameters()`, which are this rank's local shards;
- updates are one in-place `torch._foreach_lerp_` over all tensors;
- nothing is allocated before `ema_start`; at the start the average is the current weights;
- evaluation and prediction swap the average in by exchanging tensor storage (no copy) and back.

Smoothing is per batch: with `update_interval=k` each update uses `smoothing ** k`, so `half_life`
means the same number of batches whatever the interval.
"""

import contextlib
import logging

import torch
from composer.core import Algorithm, Event, State, Time, TimeUnit

log = logging.getLogger(__name__)

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _batches(value, name: str) -> int:
    """An int, or a Composer time string in batches ("100ba")."""
    if isinstance(value, int):
        return value
    time = Time.from_timestring(str(value))
    if time.unit != TimeUnit.BATCH:
        raise ValueError(f"EMA {name}={value!r} must be in batches, e.g. '100ba'")
    return time.value


def _strip_wrappers(name: str) -> str:
    # DDP adds "module."; checkpoints should not depend on how the model was wrapped.
    return name.removeprefix("module.")


class EMA(Algorithm):
    """Exponential moving average of the trainable parameters.

    Args:
        half_life: batches after which a weight's contribution halves ("100ba" or 100). Give this
            or `smoothing`.
        smoothing: per-batch decay s in e <- s * e + (1 - s) * w.
        update_interval: update every this many batches.
        ema_start: batch at which the average starts (initialised from the current weights).
        storage: "fp32" (default), "bf16" or "fp16" for the stored average.
        offload: keep the average in CPU memory (pinned when CUDA is available).
    """

    def __init__(
        self,
        half_life: str | int | None = None,
        smoothing: float | None = None,
        update_interval: str | int = 1,
        ema_start: str | int = 0,
        storage: str = "fp32",
        offload: bool = False,
    ):
        if (half_life is None) == (smoothing is None):
            raise ValueError("EMA: give exactly one of half_life or smoothing")
        if storage not in _DTYPES:
            raise ValueError(f"EMA storage={storage!r}; choose one of {sorted(_DTYPES)}")
        self.update_interval = _batches(update_interval, "update_interval")
        self.ema_start = _batches(ema_start, "ema_start")
        if self.update_interval < 1:
            raise ValueError(f"EMA update_interval must be >= 1 batch, got {update_interval!r}")
        if smoothing is None:
            smoothing = 0.5 ** (1.0 / _batches(half_life, "half_life"))
        if not 0.0 <= smoothing < 1.0:
            raise ValueError(f"EMA smoothing must be in [0, 1), got {smoothing}")
        self.smoothing = smoothing
        self.storage = _DTYPES[storage]
        self.offload = offload
        self.start_batch: int | None = None  # batch at which the average was initialised
        self._names: list[str] = []
        self._params: list[torch.nn.Parameter] = []
        self._ema: list[torch.Tensor] | None = None
        self._loaded: dict | None = None  # from a checkpoint, applied once the model is final
        self._swapped = False
        self._raw: list[torch.Tensor] | None = None  # raw weights while swapped (slow path only)
        self._fast_path = False

    # -- Composer hooks ------------------------------------------------------------------------
    def match(self, event: Event, state: State) -> bool:
        return event in (
            Event.FIT_START,
            Event.BATCH_END,
            Event.EVAL_START,
            Event.EVAL_END,
            Event.PREDICT_START,
            Event.PREDICT_END,
        )

    def apply(self, event: Event, state: State, logger) -> None:
        if event == Event.FIT_START:
            # Bind now, not at INIT: FSDP replaces the parameters when it wraps the model.
            self._bind(state.model)
            if self._loaded is not None:
                self._restore(self._loaded)
                self._loaded = None
        if event in (Event.EVAL_START, Event.PREDICT_START):
            self.swap_in()
        elif event in (Event.EVAL_END, Event.PREDICT_END):
            self.swap_out()
        else:  # FIT_START may start the average (batch 0 or a resumed batch); it never updates it
            self.step(int(state.timestamp.batch), update=event == Event.BATCH_END)

    # -- the average ---------------------------------------------------------------------------
    def _bind(self, model: torch.nn.Module) -> None:
        named = [(_strip_wrappers(n), p) for n, p in model.named_parameters() if p.requires_grad]
        self._names = [n for n, _ in named]
        self._params = [p for _, p in named]

    def _device(self, param: torch.Tensor) -> torch.device:
        return torch.device("cpu") if self.offload else param.device

    def _allocate_from_params(self) -> None:
        """One flat buffer per device holds the whole average (views per parameter): exactly
        numel x element size bytes, with no per-tensor allocator rounding."""
        pin = self.offload and torch.cuda.is_available()
        by_device: dict[torch.device, list[int]] = {}
        for i, p in enumerate(self._params):
            by_device.setdefault(self._device(p), []).append(i)
        self._ema = [None] * len(self._params)
        for device, indices in by_device.items():
            total = sum(self._params[i].numel() for i in indices)
            flat = torch.empty(total, dtype=self.storage, device=device, pin_memory=pin)
            offset = 0
            for i in indices:
                p = self._params[i]
                self._ema[i] = flat[offset : offset + p.numel()].view(p.shape)
                self._ema[i].copy_(p.detach())
                offset += p.numel()

        # Same dtype and device as the parameters: one fused lerp per update and free swaps.
        self._fast_path = all(
            e.dtype == p.dtype and e.device == p.device for e, p in zip(self._ema, self._params)
        )

    @torch.no_grad()
    def step(self, batch: int, update: bool = True) -> None:
        """After an optimizer step, with the number of batches trained so far: start or update."""
        if self._ema is None:
            if batch >= self.ema_start:
                self._allocate_from_params()
                self.start_batch = batch
                log.info("EMA started at batch %d (%d tensors)", batch, len(self._ema))
            return
        if not update or (batch - self.start_batch) % self.update_interval:
            return
        weight = 1.0 - self.smoothing**self.update_interval
        if self._fast_path:
            torch._foreach_lerp_(self._ema, self._params, weight)  # no_grad: params are read only
        else:  # bf16 storage or offload: one converted copy of one parameter at a time
            for e, p in zip(self._ema, self._params):
                e.lerp_(p.detach().to(e.device, e.dtype, non_blocking=True), weight)

    @torch.no_grad()
    def swap_in(self) -> None:
        """Put the averaged weights into the model; the raw ones are kept to be restored."""
        if self._ema is None or self._swapped:
            return
        if self._fast_path:  # exchange storage: no copy, no extra memory
            for i, p in enumerate(self._params):
                p.data, self._ema[i] = self._ema[i], p.data
        else:  # keep the raw weights at full precision (on the storage device) while swapped
            self._raw = [p.detach().to(e.device, copy=True) for e, p in zip(self._ema, self._params)]
            for e, p in zip(self._ema, self._params):
                p.copy_(e)
        self._swapped = True

    @torch.no_grad()
    def swap_out(self) -> None:
        """Restore the raw training weights exactly."""
        if not self._swapped:
            return
        if self._raw is None:
            for i, p in enumerate(self._params):
                p.data, self._ema[i] = self._ema[i], p.data
        else:
            for raw, p in zip(self._raw, self._params):
                p.copy_(raw)
            self._raw = None
        self._swapped = False

    @contextlib.contextmanager
    def averaged_weights(self):
        """`with ema.averaged_weights(): model.generate(...)` samples from the average."""
        self.swap_in()
        try:
            yield
        finally:
            self.swap_out()

    # -- checkpoints ---------------------------------------------------------------------------
    def state_dict(self) -> dict:
        if self._swapped:
            raise RuntimeError("EMA: cannot checkpoint while the averaged weights are swapped in")
        ema = None if self._ema is None else dict(zip(self._names, self._ema))
        return {"start_batch": self.start_batch, "ema": ema, "smoothing": self.smoothing}

    def load_state_dict(self, state: dict, strict: bool = False) -> None:
        # Composer loads checkpoints before FIT_START, when the parameters may not be final yet.
        self._loaded = state
        if self._params:
            self._restore(state)
            self._loaded = None

    @torch.no_grad()
    def _restore(self, state: dict) -> None:
        self.start_batch = state["start_batch"]
        if state["ema"] is None:
            self._ema = None
            return
        missing = set(self._names) - set(state["ema"])
        if missing:
            raise KeyError(f"EMA checkpoint lacks {len(missing)} parameters, e.g. {sorted(missing)[:3]}")
        self._allocate_from_params()
        for name, e in zip(self._names, self._ema):
            e.copy_(state["ema"][name])

    def averaged_state(self) -> dict[str, torch.Tensor]:
        """name -> averaged tensor (empty before ema_start)."""
        return {} if self._ema is None else dict(zip(self._names, self._ema))


def find_ema(algorithms) -> EMA | None:
    return next((a for a in algorithms if isinstance(a, EMA)), None)


def ema_weights(trainer):
    """A context manager that swaps a trainer's EMA weights in, or does nothing without EMA."""
    ema = find_ema(trainer.state.algorithms)
    return ema.averaged_weights() if ema is not None else contextlib.nullcontext()
