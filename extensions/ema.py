"""A memory-efficient exponential moving average of the trainable weights, as a Composer Algorithm.

Why not `composer.algorithms.EMA`: it also copies every buffer, updates with
`e.copy_(e * s + p * (1 - s))` (three temporaries per parameter) and swaps weights through a full
clone. Here:
- only parameters with `requires_grad` are tracked (the frozen VAE and text encoder never are);
- the average is one copy of them, fp32 by default (bf16 storage and CPU offload optional), and
  under FSDP (use_orig_params) it is built from `model.parameters()`, this rank's local shards;
  checkpoints gather it whole (every rank takes part, rank 0 writes) so they load on any world
  size and export as usual; under FSDP2 it is sharded like the parameters (DTensors) and saved
  sharded with them (extensions/ema_sharded.py);
- updates are one in-place `torch._foreach_lerp_` over all tensors;
- with bf16 weights whose fp32 masters the run's optimizer keeps (extensions/master_weights.py
  MasterWeightAdamW) and fp32 storage, the average follows the masters, not the rounded weights:
  one `torch._foreach_lerp_(average, masters)`, fp32 in and out (before a parameter's first step,
  which makes its master, it reads the parameter itself);
- with CPU offload, the weights come to the host in chunks through two pinned buffers on a side
  stream, each chunk's copy waited for (a CUDA event) before the CPU reads it, the next chunk's
  copy overlapping this chunk's CPU update (extensions/ema_offload.py);
- each average is laid out like its parameter (and its master), channels-last too: CUDA's fused
  lerp needs equal strides, and the offload reads both flat in one memory order;
- nothing is allocated before `ema_start`; at the start the average is the current weights;
- evaluation and prediction swap the average in by exchanging tensor storage (no copy) and back.

Smoothing is per batch: with `update_interval=k` each update uses `smoothing ** k`, so `half_life`
means the same number of batches whatever the interval.
"""

import contextlib
import logging

import torch
from composer.core import Algorithm, Event, State, Time, TimeUnit
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

from compat.torch import uses_orig_params
from extensions import ema_fsdp1 as fsdp1
from extensions import ema_sharded
from extensions.ema_offload import ChunkedOffload, CudaCopy
from extensions.master_weights import master_of

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


def _dense_strides(p: torch.Tensor) -> tuple[int, ...]:
    """`p`'s own strides when it is dense in any dim order (channels-last too), as `empty_like(p)`
    keeps them; else row-major. Worked out from the numbers: an empty_like on the meta device made a
    tensor per parameter, which bench/ema.py's count of allocations took for real bytes."""
    expected = 1
    for d in sorted(range(p.dim()), key=p.stride):
        if p.shape[d] != 1:  # a size-1 dim's stride never matters
            if p.stride(d) != expected:
                break
            expected *= p.shape[d]
    else:
        return p.stride()
    strides, step = [], 1
    for size in reversed(p.shape):
        strides.insert(0, step)
        step *= max(size, 1)
    return tuple(strides)


class EMA(Algorithm):
    """Exponential moving average of the trainable parameters.

    Args:
        half_life: batches after which a weight's contribution halves ("100ba" or 100). Give this
            or `smoothing`.
        smoothing: per-batch decay s in e <- s * e + (1 - s) * w.
        update_interval: update every this many batches.
        ema_start: batch at which the average starts (initialised from the current weights).
        storage: "fp32" (default), "bf16" or "fp16" for the stored average.
        offload: keep the average in CPU memory (pinned when CUDA is available). Saves 4 bytes per
            trainable parameter of GPU memory (3.5 GB for sd2-base) but each update moves the
            weights over PCIe and averages them on the CPU: prefer `storage="bf16"` on the GPU, or
            offload with an `update_interval` of several batches (`make gpu-check` times each).

    `optimizers` (Composer's `state.optimizers`, set at each event; set it by hand when calling
    `step` directly) is where fp32 masters of low-precision parameters are looked up.
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
        self._fsdp_root: torch.nn.Module | None = None  # the model, when FSDP shards it
        self._model: torch.nn.Module | None = None  # the model, when FSDP2 shards it (DTensors)
        self._ema_local: list[torch.Tensor] = []  # under FSDP2: this rank's shards of the average
        self._ema: list[torch.Tensor] | None = None
        self._loaded: dict | None = None  # from a checkpoint, applied once the model is final
        self._swapped = False
        self._raw: list[torch.Tensor] | None = None  # raw weights while swapped (slow path only)
        self._fast_path = False
        self._copy = None  # offloading from a GPU: CudaCopy (a test may put a slow fake here)
        self._offload: ChunkedOffload | None = None  # the chunked update through _copy
        self.optimizers: list[torch.optim.Optimizer] = []
        self._plan: tuple | None = None  # (key, sources, fused averages, fused sources, the rest)

    # -- Composer hooks ------------------------------------------------------------------------
    def match(self, event: Event, state: State) -> bool:
        return event in (
            Event.BEFORE_LOAD,
            Event.FIT_START,
            Event.BATCH_END,
            Event.EVAL_START,
            Event.EVAL_END,
            Event.PREDICT_START,
            Event.PREDICT_END,
        )

    def apply(self, event: Event, state: State, logger) -> None:
        self.optimizers = state.optimizers
        if event == Event.BEFORE_LOAD:
            # Composer has sharded the model and loads next: under FSDP2 the sharded average, and the
            # callback that carries it in checkpoints, must exist for the checkpoint to load into
            # (extensions/ema_sharded.py).
            if ema_sharded.is_sharded([p for p in state.model.parameters() if p.requires_grad]):
                self.bind(state.model)
                if not any(isinstance(c, ema_sharded.EMAShards) for c in state.callbacks):
                    state.callbacks.append(ema_sharded.EMAShards(self))
            return
        if event == Event.FIT_START:
            # Bind now, not at INIT: FSDP replaces the parameters when it wraps the model.
            self.bind(state.model)
        if event in (Event.EVAL_START, Event.PREDICT_START):
            self.swap_in()
        elif event in (Event.EVAL_END, Event.PREDICT_END):
            self.swap_out()
        else:  # FIT_START may start the average (batch 0 or a resumed batch); it never updates it
            self.step(int(state.timestamp.batch), update=event == Event.BATCH_END)

    # -- the average ---------------------------------------------------------------------------
    def bind(self, model: torch.nn.Module) -> None:
        """Average `model`'s trainable parameters, restoring a loaded checkpoint's average. FIT_START
        calls it; so does a rerun of a finished run, which loads its last checkpoint and never fits."""
        self._bind(model)
        if self._loaded is not None:
            self._restore(self._loaded)
            self._loaded = None

    def _bind(self, model: torch.nn.Module) -> None:
        named = [(fsdp1.strip_wrappers(n), p) for n, p in model.named_parameters() if p.requires_grad]
        self._names = [n for n, _ in named]
        self._params = [p for _, p in named]
        sharded = [m for m in model.modules() if isinstance(m, FSDP)]
        if any(not uses_orig_params(m) for m in sharded):
            raise ValueError("EMA under FSDP needs use_orig_params=True (Composer's default)")
        self._fsdp_root = model if sharded else None
        self._plan = None
        self._model = model if ema_sharded.is_sharded(self._params) else None
        if self._model is not None:
            if self.offload:
                raise ValueError(
                    "EMA offload=true with a sharded model (parallelism.shard): the average is already "
                    "sharded over the GPUs; use storage: bf16 to halve it instead"
                )
            if self._ema is None:  # the template a sharded checkpoint loads into (ema_sharded.py)
                self._allocate_from_params()

    def _device(self, param: torch.Tensor) -> torch.device:
        return torch.device("cpu") if self.offload else param.device

    def _allocate_from_params(self) -> None:
        """One flat buffer per device holds the whole average (views per parameter, with its
        strides): exactly numel x element size bytes, with no per-tensor allocator rounding."""
        if self._model is not None:  # FSDP2: DTensors over this rank's shards, no strides to match
            self._ema, self._ema_local = ema_sharded.sharded_like(self._params, self.storage)
            self._fast_path = all(e.dtype == p.dtype for e, p in zip(self._ema, self._params))
            self._plan = None
            return
        pin = self.offload and torch.cuda.is_available()
        by_device: dict[torch.device, list[int]] = {}
        for i, p in enumerate(self._params):
            by_device.setdefault(self._device(p), []).append(i)
        self._ema = [None] * len(self._params)
        self._plan = None
        sources = self._sources()
        for device, indices in by_device.items():
            total = sum(self._params[i].numel() for i in indices)
            flat = torch.empty(total, dtype=self.storage, device=device, pin_memory=pin)
            offset = 0
            for i in indices:
                p = self._params[i]
                # Laid out like the parameter (channels-last too): a fused lerp over tensors of
                # different strides falls back to one kernel per tensor on CUDA, and the offload
                # copies both flat in one memory order.
                self._ema[i] = flat[offset : offset + p.numel()].as_strided(p.shape, _dense_strides(p))
                self._ema[i].copy_(sources[i].detach())  # the master, if there is one yet
                offset += p.numel()

        # Same dtype and device as the parameters: one fused lerp per update and free swaps.
        self._fast_path = all(
            e.dtype == p.dtype and e.device == p.device for e, p in zip(self._ema, self._params)
        )
        accelerator = next((p.device for p in self._params if p.device.type == "cuda"), None)
        if self.offload and self._copy is None and accelerator is not None:
            self._copy = CudaCopy(accelerator)
        if self._copy is not None:
            self._fast_path = False
            self._offload = ChunkedOffload(self._copy)  # pinned buffers made at the first update

    @torch.no_grad()
    def step(self, batch: int, update: bool = True) -> None:
        """After an optimizer step, with the number of batches trained so far: start or update."""
        if self.start_batch is None:
            if batch >= self.ema_start:
                if self._model is None or self._ema is None:
                    self._allocate_from_params()
                else:  # FSDP2's placeholder, allocated at bind: the average starts from the weights now
                    torch._foreach_copy_(self._ema_local, [ema_sharded.local(p) for p in self._params])
                self.start_batch = batch
                log.info("EMA started at batch %d (%d tensors)", batch, len(self._ema))
            return
        if not update or (batch - self.start_batch) % self.update_interval:
            return
        weight = 1.0 - self.smoothing**self.update_interval
        if self._model is not None:  # shard into shard, with no communication
            shards = [ema_sharded.local(p) for p in self._params]
            if self._fast_path:
                torch._foreach_lerp_(self._ema_local, shards, weight)
            else:
                for e, shard in zip(self._ema_local, shards):
                    e.lerp_(shard.to(e.dtype), weight)
            return
        if self._fast_path:
            torch._foreach_lerp_(self._ema, self._params, weight)  # no_grad: params are read only
            return
        _, sources, fused_ema, fused_sources, rest = self._update_plan()
        if self._offload is not None:
            self._offload.update(self._ema, sources, weight)
            return
        if fused_ema:  # fp32 masters into an fp32 average (or same-dtype parameters): one call
            torch._foreach_lerp_(fused_ema, fused_sources, weight)
        for e, src in rest:  # e.g. bf16 storage of fp32 weights: one converted copy at a time
            e.lerp_(src.detach().to(e.dtype), weight)

    def _master(self, p: torch.Tensor) -> torch.Tensor | None:
        return next((m for o in self.optimizers if (m := master_of(o, p)) is not None), None)

    def _sources(self) -> list[torch.Tensor]:
        """What each average follows: its parameter's fp32 master where the storage is fp32 and the
        run's optimizer keeps one (MasterWeightAdamW, from the parameter's first step on), else the
        parameter. Never masters under FSDP (the recipes refuse bf16 weights with it)."""
        if self.storage != torch.float32 or self._fsdp_root is not None or not self.optimizers:
            return self._params
        return [m if (m := self._master(p)) is not None else p for p in self._params]

    def _update_plan(self) -> tuple:
        """(check, sources, fused averages, their sources, [(average, source)] of the rest), kept
        while the optimizers' state is unchanged. A parameter's first step adds its state (and
        master): the state's length changes. A load replaces every master: one master of the plan
        is compared by identity with the optimizer's (the plan holds it, so no new tensor can reuse
        its id)."""
        lengths = tuple((id(o), len(o.state)) for o in self.optimizers)
        if self._plan is not None:
            (planned_lengths, probe, master), *_ = self._plan
            if planned_lengths == lengths and (probe is None or self._master(probe) is master):
                return self._plan
        sources = self._sources()
        pairs = list(zip(self._ema, sources))
        fused = [(e, src) for e, src in pairs if e.dtype == src.dtype and e.device == src.device]
        rest = [(e, src) for e, src in pairs if e.dtype != src.dtype or e.device != src.device]
        probe = next(((p, src) for p, src in zip(self._params, sources) if src is not p), (None, None))
        self._plan = (
            (lengths, *probe),
            sources,
            [e for e, _ in fused],
            [src for _, src in fused],  # read only, under no_grad
            rest,
        )
        return self._plan

    @torch.no_grad()
    def swap_in(self) -> None:
        """Put the averaged weights into the model; the raw ones are kept to be restored."""
        if self.start_batch is None or self._swapped:
            return
        if self._model is not None:  # FSDP2: into the shards, then gather anew at the next forward
            self._raw = [ema_sharded.local(p).clone() for p in self._params]
            for e, p in zip(self._ema_local, self._params):
                ema_sharded.local(p).copy_(e)
            self._swapped = True
            ema_sharded.reshard(self._model)
            return
        # Exchange storage: no copy, no extra memory. Not under FSDP, whose parameters are views
        # into its flat shard: it would copy the new storage into that shard and re-view.
        if self._fast_path and self._fsdp_root is None:
            for i, p in enumerate(self._params):
                p.data, self._ema[i] = self._ema[i], p.data
        else:  # keep the raw weights at full precision (on the storage device) while swapped
            self._raw = [p.detach().to(e.device, copy=True) for e, p in zip(self._ema, self._params)]
            for e, p in zip(self._ema, self._params):
                p.copy_(e)
        self._swapped = True
        if self._fsdp_root is not None:
            fsdp1.drop_gathered_weights(self._fsdp_root)

    @torch.no_grad()
    def swap_out(self) -> None:
        """Restore the raw training weights exactly."""
        if not self._swapped:
            return
        if self._model is not None:
            for raw, p in zip(self._raw, self._params):
                ema_sharded.local(p).copy_(raw)
            self._raw, self._swapped = None, False
            ema_sharded.reshard(self._model)
            return
        if self._raw is None:
            for i, p in enumerate(self._params):
                p.data, self._ema[i] = self._ema[i], p.data
        else:
            for raw, p in zip(self._raw, self._params):
                p.copy_(raw)
            self._raw = None
        self._swapped = False
        if self._fsdp_root is not None:
            fsdp1.drop_gathered_weights(self._fsdp_root)

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
        if self._ema is None:
            ema = None
        elif self._model is not None:
            # The DTensors travel in the EMAShards callback's state, which torch distributed checkpoint
            # saves shard by shard (it pickles an algorithm's state whole: Composer keeps it in a tuple).
            ema = ema_sharded.SHARDED
        elif self._fsdp_root is not None:
            ema = fsdp1.gather_average(self)
        else:
            ema = dict(zip(self._names, self._ema))
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
        if self._model is not None or state["ema"] == ema_sharded.SHARDED:
            if self._model is None or state["ema"] != ema_sharded.SHARDED:
                raise ValueError(
                    "EMA: a checkpoint saved with sharding (parallelism.shard) loads only into a sharded "
                    "model, and the reverse; resume it sharded"
                )
            return  # the shards were loaded into the average itself (EMAShards' state)
        if state["ema"] is None:
            self._ema = None
            return
        missing = set(self._names) - set(state["ema"])
        if missing:
            raise KeyError(f"EMA checkpoint lacks {len(missing)} parameters, e.g. {sorted(missing)[:3]}")
        self._allocate_from_params()
        if self._fsdp_root is not None:
            fsdp1.scatter_average(self, state["ema"])
            return
        for name, e in zip(self._names, self._ema):
            e.copy_(state["ema"][name])

    def sharded_average(self) -> dict[str, torch.Tensor]:
        """Under FSDP2: name -> the average's DTensor, allocated at bind (a placeholder before
        `ema_start`), what a sharded checkpoint saves and loads into (ema_sharded.EMAShards)."""
        return dict(zip(self._names, self._ema))

    def averaged_state(self) -> dict[str, torch.Tensor]:
        """name -> averaged tensor (empty before ema_start)."""
        return {} if self.start_batch is None else dict(zip(self._names, self._ema))


def find_ema(algorithms) -> EMA | None:
    return next((a for a in algorithms if isinstance(a, EMA)), None)


def ema_weights(trainer):
    """A context manager that swaps a trainer's EMA weights in, or does nothing without EMA."""
    ema = find_ema(trainer.state.algorithms)
    return ema.averaged_weights() if ema is not None else contextlib.nullcontext()
