"""The planner's memory table rows and its advice when a run does not fit (recipes.plan, and the
check before a run builds its model: recipes/memory_check.py): the fewest changes the recipe does
not have yet (a larger shard, a smaller microbatch, recomputed activations) that make it fit, or
plainly that none it knows of would. recipes/memory.py does the arithmetic.
"""

from dataclasses import dataclass

from recipes.memory import COLUMNS, fsdp1, gb, run_shard, shape_memory
from recipes.memory_bases import NO_BASE, add_base_rows, base_choices, smaller_bases


def plan_memory(
    run, rows: list[dict], shards, gpu_memory: float, gpus_per_node: int
) -> tuple[list[str], bool]:
    """Add `memory` to each row of recipes.plan (one entry per shape: `shards` that divide its GPU
    count, or the run's own shape; `fits`: its total within `gpu_memory` GB). Return a line for each
    count with a shape that does not fit, and whether some count has no shape that fits."""
    notes, failed = [], False
    for row in rows:
        row["memory"] = []
        if "error" in row:  # no such run
            continue
        gpus, microbatch = row["gpus"], row["microbatch"]
        if shards:
            listed = [(s, True) for s in shards if gpus % s == 0]
        else:
            listed = [run_shard(run, gpus, gpus_per_node)]
        own_base = run.model.get("base_weights") if base_choices(run) else NO_BASE
        for shard, shard_weights in listed:
            entry = shape_memory(run, gpus, shard, microbatch, shard_weights)
            base = {} if own_base is NO_BASE else {"base_weights": own_base, "alternative": False}
            row["memory"].append({**entry, **base, "fits": entry["total"] <= gpu_memory})
        fitting = [m["shard"] for m in row["memory"] if m["fits"]]
        failed = failed or not fitting
        over = [m for m in row["memory"] if not m["fits"]]
        if not row["memory"]:
            notes.append(f"at {gpus} GPUs: no shard of {shards} divides {gpus}")
        elif over:
            needs = ", ".join(f"shard {m['shard']} needs {gb(m['total'])} GB" for m in over)
            line = f"at {gpus} GPUs: does not fit in {gpu_memory:g} GB per GPU (--gpu-memory): {needs}; "
            if fitting:
                notes.append(line + f"the smallest listed shard that fits is {min(fitting)}")
            else:
                notes.append(line + suggest(run, row, gpu_memory, gpus_per_node))
        if own_base is not NO_BASE and row["memory"]:
            notes.append(add_base_rows(run, row, listed, gpu_memory))
    return notes, failed


@dataclass(frozen=True)
class _Variant:
    """The run with some settings changed, and the memory of its shape."""

    changes: dict  # kind (of _KINDS) -> the overrides that make it, as on the command line
    shard: int
    microbatch: int  # counted
    recomputes: bool  # blocks recomputed in the backward, by the run's own settings or a change
    memory: dict  # shape_memory's

    @property
    def overrides(self) -> str:
        return " ".join(o for kind in _KINDS for o in self.changes.get(kind, ()))


# The settings the advice may change, in the order it prefers them when several fit alone: more GPUs
# per copy of the model (more communication), a smaller microbatch (more, smaller steps), recomputed
# blocks (about a third more compute).
_KINDS = ("shard", "microbatch", "recompute")


def _recompute_changes(model: dict, trainer: dict, shard: int) -> dict:
    """The overrides that recompute the denoiser's blocks in the backward at `shard` (run_footprint's
    rule); {} when the run already does."""
    fsdp = (trainer.get("parallelism_config") or {}).get("fsdp")
    if model.get("gradient_checkpointing"):
        return {}
    if shard == 1:  # unsharded, only diffusers' own recomputes
        return {"model.gradient_checkpointing": True}
    changes = {} if model.get("activation_checkpointing") else {"model.activation_checkpointing": "blocks"}
    if fsdp is not None:  # Composer's FSDP recomputes only with its own switch on (recipes/checks.py)
        key = "trainer.parallelism_config.fsdp"
        if not fsdp.get("activation_checkpointing"):
            changes[f"{key}.activation_checkpointing"] = True
        if fsdp.get("activation_checkpointing_reentrant", True):
            changes[f"{key}.activation_checkpointing_reentrant"] = False
    return changes


def _unsharded_by_composer(run) -> dict:
    """The run's trainer keys without Composer's FSDP (trainer.parallelism_config), which
    parallelism.shard replaces."""
    return {k: v for k, v in run.trainer.items() if k != "parallelism_config" or fsdp1(run) is None}


def _shard_problem(run, shard: int) -> str | None:
    """Why the config checks would refuse the run at `parallelism.shard=shard` (recipes/parallelism.py)."""
    from recipes.parallelism import Parallelism, config_problem

    return config_problem(Parallelism(shard=shard), run.model, _unsharded_by_composer(run))


def _variant(run, gpus: int, own: tuple[int, bool], shard: int, recompute: bool, microbatch: tuple[int, int]):
    """The run at `shard` (`own`: the run's shard and whether it shards the weights; another is
    `parallelism.shard`, FSDP2, in place of Composer's FSDP), with blocks recomputed if `recompute`, at
    `microbatch` (the one counted, and the run's own); None where `recompute` changes nothing (the run
    already recomputes) or the config checks would refuse the shape (recipes/parallelism.py)."""
    import copy

    changes, shard_weights = {}, own[1]
    model, trainer = dict(run.model), copy.deepcopy(run.trainer)
    if shard != own[0]:
        if _shard_problem(run, shard) is not None:
            return None
        # Composer's FSDP and parallelism.shard do not go together: the one replaces the other.
        changes["shard"] = [] if fsdp1(run) is None else ["~trainer.parallelism_config"]
        changes["shard"].append(f"parallelism.shard={shard}")
        trainer, shard_weights = copy.deepcopy(_unsharded_by_composer(run)), True
    extra = _recompute_changes(model, trainer, shard)
    if recompute:
        if not extra:
            return None
        changes["recompute"] = []
        for key, value in extra.items():
            section, *path, name = key.split(".")
            target = model if section == "model" else trainer
            for part in path:
                target = target.setdefault(part, {})
            target[name] = value
            changes["recompute"].append(f"{key}={str(value).lower() if isinstance(value, bool) else value}")
    counted, own_microbatch = microbatch
    if counted != own_microbatch:
        changes["microbatch"] = [f"trainer.device_train_microbatch_size={counted}"]
    variant = copy.copy(run)
    variant.model, variant.trainer = model, trainer
    memory = shape_memory(variant, gpus, shard, counted, shard_weights)
    return _Variant(changes, shard, counted, recompute or not extra, memory)


def suggest(run, row: dict, gpu_memory: float, gpus_per_node: int, cpu: bool = False) -> str:
    """What to change so that `row`'s GPU count fits in `gpu_memory` GB: the smallest shard (a divisor of
    a node's GPUs and of the count) that fits, else the fewest other changes that do, each naming only
    settings the run does not have yet; or, plainly, that no setting known here fits. `cpu`: a CPU run's
    (recipes/memory_check.py), whose devices are processes sharing the host's memory."""
    gpus = row["gpus"]
    counted = 1 if row["microbatch"] in (None, "auto") else row["microbatch"]  # auto: as shape_memory
    shards = [s for s in range(1, gpus_per_node + 1) if gpus_per_node % s == 0 and gpus % s == 0]
    own = run_shard(run, gpus, gpus_per_node)
    for shard in shards:
        alone = _variant(run, gpus, own, shard, False, (counted, counted))
        if alone is not None and alone.memory["total"] <= gpu_memory:
            total = alone.memory["total"]
            if not alone.changes:  # where --shard listed others
                return f"the run's own shard, {shard}, fits ({gb(total)} GB)"
            return f"the smallest shard that fits is {shard} ({gb(total)} GB: {alone.overrides})"
    # Smaller microbatches: the divisors of the per-device batch below the one counted.
    per_device = row["per_device_batch"] or counted
    variants = []
    for shard in sorted({*shards, own[0]}):
        for recompute in (False, True):
            for m in [m for m in range(counted, 0, -1) if per_device % m == 0]:
                variant = _variant(run, gpus, own, shard, recompute, (m, counted))
                variants += [] if variant is None else [variant]
    fitting = [v for v in variants if v.memory["total"] <= gpu_memory]
    # Sharding ruled out by the rest of the config (bf16 weights, CUDA graphs): said, with the way out.
    problem = None if shards[-1] <= own[0] else _shard_problem(run, shards[-1])
    ruled_out = "" if problem is None else f"; sharding is not counted ({problem})"
    if not fitting:
        least = min(variants, key=lambda v: (v.memory["total"], len(v.changes)))
        smaller = smaller_bases(run, row, own, gpu_memory)  # a LoRA run's frozen base, stored smaller
        if smaller:
            return (
                f"no shard, microbatch or recomputation it does not have yet fits (the least is "
                f"{gb(least.memory['total'])} GB, {gb(least.memory['frozen'])} GB of it frozen networks); "
                f"it fits with {smaller}"
            )
        return _nothing_fits(least, row["microbatch"], gpu_memory, gpus_per_node, problem, cpu)
    fewest = min(len(v.changes) for v in fitting)
    best = {}  # per set of kinds changed: the smallest shard, then the largest microbatch
    for v in sorted(fitting, key=lambda v: (v.shard, -v.microbatch)):
        if len(v.changes) == fewest:
            best.setdefault(frozenset(v.changes), v)
    ways = sorted(best.values(), key=lambda v: sorted(_KINDS.index(k) for k in v.changes))
    as_is = (counted, counted)
    if problem is None:
        node = _variant(run, gpus, own, max(shards[-1], own[0]), False, as_is)
        head = f"no shard up to a node ({_devices(gpus_per_node, cpu)}) fits"
    else:
        node = _variant(run, gpus, own, own[0], False, as_is)
        head = "the run's shard does not fit"
    return (
        f"{head} ({gb(node.memory['total'])} GB at shard {node.shard}, {gb(node.memory['activations'])} "
        "GB of it activations); it fits with "
        + ", or with ".join(f"{v.overrides} ({gb(v.memory['total'])} GB)" for v in ways)
        + ruled_out
    )


def _nothing_fits(
    least: _Variant, microbatch, gpu_memory: float, gpus_per_node: int, problem, cpu: bool = False
) -> str:
    """The line for a count where no setting known here fits: the least memory any of them needs, the
    settings that give it (the run's own, or the overrides), what that memory is made of, and what
    is left to try (`problem`: why the config rules out sharding, if it does)."""

    def setting(kind: str, what: str) -> str:
        if kind in least.changes:
            return f"{what} ({' '.join(least.changes[kind])})"
        if kind == "microbatch" and microbatch == "auto":
            return f"{what} (auto: the planner counts 1)"
        return f"{what} (as the run is)"

    settings = [
        setting("shard", f"shard {least.shard}"),
        setting("microbatch", f"microbatch {least.microbatch}"),
    ]
    if least.recomputes:
        settings.append(setting("recompute", "activations recomputed"))
    parts = ", ".join(f"{c} {gb(least.memory[c])}" for c in COLUMNS if least.memory[c] > 0)
    if problem is None:
        left = f"a shard across nodes (over {_devices(gpus_per_node, cpu)}), "
    else:
        left = f"sharding, which the config rules out now ({problem}), "
    return (
        f"no setting we know fits this in {gpu_memory:g} GB per {'process' if cpu else 'GPU'}: the least it "
        f"needs is {gb(least.memory['total'])} GB ({parts} GB), with {', '.join(settings)}; what is left: "
        f"{'a host' if cpu else 'GPUs'} with more memory, {left}or a smaller model or resolution"
    )


def _devices(count: int, cpu: bool) -> str:
    """`count` GPUs, or on a CPU run processes."""
    if cpu:
        return f"{count} process" + ("es" if count != 1 else "")
    return f"{count} GPU" + ("s" if count != 1 else "")
