"""Run config: a composed YAML (recipes/compose.py `load_config`) checked against a typed schema.

One YAML is one complete run. `parse_config(cfg)` turns it into a `RunConfig`,
rejecting unknown keys with a message that names the key and the nearest valid one, values that
the optimizer, scheduler, callbacks and algorithms would refuse (it builds each once), and
combinations of keys no run can train with (recipes/checks.py), all before any model or data is
built. `check_device` (build_trainer calls it before it builds anything) checks the config against
this machine.
"""

import difflib
import inspect
import re
import types
import typing
from dataclasses import MISSING, dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from data.loader import EvalDataConfig, ImageCaptionDataConfig
from extensions.keep_best import config_problem as keep_best_problem
from extensions.quality_target import config_problem as quality_target_problem
from recipes.checks import (
    cudagraphs_problem,
    device_problem,
    fsdp_problem,
    model_values_problem,
    param_dtype_problem,
    resolution_problem,
    save_folder_problem,
)
from recipes.dreambooth import DreamBoothConfig
from recipes.dreambooth import config_problem as dreambooth_problem
from recipes.evaluators import RECIPE_TRAINER_KEYS, with_fixed_timesteps
from recipes.parallelism import Parallelism, config_problem


class ConfigError(ValueError):
    """A config mistake, reported before any model or data is built."""


@dataclass
class DataConfig:
    train: ImageCaptionDataConfig = field(default_factory=ImageCaptionDataConfig)
    eval: EvalDataConfig | None = None


@dataclass
class RunConfig:
    run_name: str
    global_train_batch_size: int
    optimizer: dict  # {_target_: torch.optim.AdamW, lr: ...}; params are filled in
    model: dict  # {preset: NAME, **options}: keyword arguments of the builder models.MODELS[NAME]
    seed: int = 17
    data: DataConfig = field(default_factory=DataConfig)
    scheduler: dict | None = None  # {_target_: composer.optim....}
    # Named so a defaults list or an override can replace one entry: {name: {_target_: ..., ...}}.
    algorithms: dict[str, dict] = field(default_factory=dict)
    callbacks: dict[str, dict] = field(default_factory=dict)
    loggers: dict[str, dict] = field(default_factory=dict)
    trainer: dict = field(default_factory=dict)  # keyword arguments of composer.Trainer
    # Sharding (FSDP2) and replication: recipes/parallelism.py.
    parallelism: Parallelism = field(default_factory=Parallelism)
    # A recipe YAML that writes `model.pretrained` when that folder is missing (the tiny recipe's
    # VAE: yamls/tiny-vae.yaml). Run once, on first use, like `data.train.prepare`.
    prepare_pretrained: str | None = None
    # DreamBooth: instance images and prompt, optional prior preservation (recipes/dreambooth.py).
    dreambooth: DreamBoothConfig | None = None


# composer.Trainer arguments that the recipe fills in from other keys of the config.
_TRAINER_KEYS_SET_BY_RECIPE = {
    "model": "model",
    "train_dataloader": "data.train",
    "eval_dataloader": "data.eval",
    "optimizers": "optimizer",
    "schedulers": "scheduler",
    "algorithms": "algorithms",
    "callbacks": "callbacks",
    "loggers": "loggers",
    "seed": "seed",
    "run_name": "run_name",
}


def parse_config(cfg: DictConfig | dict) -> RunConfig:
    if isinstance(cfg, DictConfig):
        missing = sorted(OmegaConf.missing_keys(cfg))
        if missing:  # `???` in a recipe: a value only the user can give (a bucket, a folder)
            raise ConfigError(
                f"config key{'s' if len(missing) > 1 else ''} {', '.join(repr(k) for k in missing)} "
                f"must be set, e.g. {missing[0]}=VALUE on the command line"
            )
        cfg = OmegaConf.to_container(cfg, resolve=True)
    raw = {k: v for k, v in cfg.items() if k != "defaults"}
    for section in ("algorithms", "callbacks", "loggers"):  # `name: null` removes an inherited entry
        if isinstance(raw.get(section), dict):
            raw[section] = {k: v for k, v in raw[section].items() if v is not None}
    run = _build(RunConfig, raw, "")
    _check_model_keys(run.model)
    run.model = with_fixed_timesteps(run.model, run.data.train.holdout)  # recipes/evaluators.py
    for split in ("train", "eval"):
        if (data := getattr(run.data, split)) is not None:
            _refuse(resolution_problem(run.model["preset"], f"data.{split}", data.resolution))
    _refuse(dreambooth_problem(run.dreambooth, run.data.train, run.global_train_batch_size))
    _check_trainer_keys(run.trainer)
    _check_max_duration(run.trainer)
    _refuse(fsdp_problem(run.trainer))
    _refuse(config_problem(run.parallelism, run.model, run.trainer))
    for section in ("algorithms", "callbacks", "loggers"):
        for name, spec in getattr(run, section).items():
            _check_target(spec, f"{section}.{name}")
    _check_target(run.optimizer, "optimizer", supplied=("params",))
    _refuse(param_dtype_problem(run.model, run.optimizer, run.trainer))
    _refuse(cudagraphs_problem(run.model, run.trainer))
    if run.scheduler is not None:
        _check_target(run.scheduler, "scheduler")
    _check_values(run)
    _check_export_folders(run)
    _refuse(quality_target_problem(run.callbacks, run.data.eval, run.trainer))
    _refuse(keep_best_problem(run.trainer, run.data.train.holdout, run.data.eval))
    run.trainer = _with_dist_timeout(run)
    return run


def _with_dist_timeout(run: RunConfig) -> dict:
    """`trainer.dist_timeout` derived from the hang watchdog's allowances (extensions/watchdog.py says
    how), so a collective never times out before the watchdog has written the stacks."""
    from extensions.watchdog import dist_timeout

    try:
        timeout = dist_timeout(run.callbacks, run.trainer.get("dist_timeout"))
    except ValueError as err:
        raise ConfigError(str(err)) from err
    return run.trainer if timeout is None else {**run.trainer, "dist_timeout": timeout}


def _check_export_folders(run: RunConfig) -> None:
    """A SavePretrained callback's folder holding another run's export: refused now, not at fit start."""
    from extensions.save_pretrained import WRITER, check_folder

    for name, spec in run.callbacks.items():
        if spec.get("_target_") == WRITER and spec.get("folder") is not None:
            try:
                check_folder(Path(spec["folder"]), run.run_name)
            except ValueError as err:
                raise ConfigError(f"callbacks.{name}.{err}") from err


def _unknown_key(path: str, key: str, valid) -> ConfigError:
    where = f"{path}.{key}" if path else key
    close = difflib.get_close_matches(key, list(valid), n=1, cutoff=0.5)
    hint = f"; did you mean '{close[0]}'?" if close else f"; valid keys here: {', '.join(sorted(valid))}"
    return ConfigError(f"unknown config key '{where}'{hint}")


def _build(cls, raw: Any, path: str):
    if not isinstance(raw, dict):
        raise ConfigError(f"'{path or 'config'}' must be a mapping, got {raw!r}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in fields(cls)}
    for key in raw:
        if key not in names:
            raise _unknown_key(path, key, names)
    kwargs = {}
    for f in fields(cls):
        where = f"{path}.{f.name}" if path else f.name
        if f.name not in raw:
            if f.default is MISSING and f.default_factory is MISSING:
                raise ConfigError(f"required config key '{where}' is missing")
            continue
        kwargs[f.name] = _coerce(hints[f.name], raw[f.name], where)
    try:
        return cls(**kwargs)
    except ValueError as err:  # a section's own checks (data.*: data/streams.py), which start with the key
        raise ConfigError(f"{path}.{err}" if path else str(err)) from err


def _coerce(hint, value, where: str):
    options = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
    if value is None:
        if type(None) in options:
            return None
        raise ConfigError(f"config key '{where}' must be set (it is empty)")
    for option in options:
        if is_dataclass(option):
            return _build(option, value, where)
    base = [typing.get_origin(o) or o for o in options if o is not type(None)]
    ok = (
        (bool in base and isinstance(value, bool))
        or (int in base and isinstance(value, int) and not isinstance(value, bool))
        or (float in base and isinstance(value, (int, float)) and not isinstance(value, bool))
        or (str in base and isinstance(value, str))
        or (dict in base and isinstance(value, dict))
        or Any in base
    )
    if not ok:
        names = " or ".join(getattr(b, "__name__", str(b)) for b in base)
        raise ConfigError(f"config key '{where}' must be {names}, got {value!r}")
    return float(value) if base == [float] else value


def _check_model_keys(model: dict) -> None:
    from models import MODELS

    if model.get("preset") not in MODELS:
        raise ConfigError(f"'model.preset' must be one of {sorted(MODELS)}, got {model.get('preset')!r}")
    params = set(inspect.signature(MODELS[model["preset"]]).parameters)
    for key in model:
        if key not in params:
            raise _unknown_key("model", key, params)
    _refuse(model_values_problem(model))
    from models.build import build_model, check_model_options

    if MODELS[model["preset"]] is build_model:  # the `-vae` presets' builder has no such options
        try:
            check_model_options(**model)
        except (ValueError, TypeError) as err:
            message = str(err)
            raise ConfigError(message if message.startswith("model") else f"model: {message}") from err


def _check_trainer_keys(trainer: dict) -> None:
    from composer import Trainer

    # composer.Trainer's arguments, and the recipe's own keys under `trainer:` (trainer.keep_best)
    params = (set(inspect.signature(Trainer.__init__).parameters) - {"self"}) | set(RECIPE_TRAINER_KEYS)
    for key in trainer:
        if key in _TRAINER_KEYS_SET_BY_RECIPE:
            raise ConfigError(
                f"'trainer.{key}' is set by the recipe; use the top-level key "
                f"'{_TRAINER_KEYS_SET_BY_RECIPE[key]}' instead"
            )
        if key not in params:
            raise _unknown_key("trainer", key, params - set(_TRAINER_KEYS_SET_BY_RECIPE))


def _check_target(spec: Any, where: str, supplied: tuple[str, ...] = ()) -> None:
    """`spec`'s `_target_` imports and its keyword arguments bind to its signature (nested `_target_`
    entries too), so a misspelt optimizer or callback argument fails here, before anything is built.
    `supplied`: arguments the recipe adds itself (an optimizer's `params`)."""
    if not isinstance(spec, dict) or "_target_" not in spec:
        raise ConfigError(f"'{where}' needs a '_target_' naming the class to build, got {spec!r}")
    from hydra.utils import get_object

    try:
        target = get_object(spec["_target_"])
        params = inspect.signature(target).parameters
    except Exception as err:  # noqa: BLE001 - an unimportable target is a config error, whatever the cause
        raise ConfigError(
            f"'{where}._target_': cannot import {spec['_target_']!r} ({_import_hint(spec['_target_'], err)})"
        ) from err
    kwargs = {k: v for k, v in spec.items() if not k.startswith("_")}  # _partial_ etc. are Hydra's
    kinds = inspect.Parameter
    if not any(p.kind == kinds.VAR_KEYWORD for p in params.values()):  # **kwargs takes anything
        named = {n for n, p in params.items() if p.kind in (kinds.POSITIONAL_OR_KEYWORD, kinds.KEYWORD_ONLY)}
        for key in kwargs:
            if key not in named:
                raise _unknown_key(where, key, named - set(supplied))
        missing = [
            n
            for n, p in params.items()
            if n in named and p.default is kinds.empty and n not in kwargs and n not in supplied
        ]
        if missing and not spec.get("_partial_"):
            raise ConfigError(f"'{where}' ({spec['_target_']}) needs {', '.join(repr(m) for m in missing)}")
    for key, value in kwargs.items():
        if key in params and _wants_number(params[key]) and isinstance(value, bool | str | list | dict):
            # A constructor compares it with a number (torch: "'<=' not supported between 'float'
            # and 'str'") or keeps it until the first step uses it.
            raise ConfigError(f"'{where}.{key}' must be a number, got {value!r}")
        if isinstance(value, dict) and "_target_" in value:
            _check_target(value, f"{where}.{key}")


def _import_hint(target: str, err: Exception) -> str:
    """Why `target` does not import, in one line, with the nearest name its module has."""
    import importlib

    module_name, _, name = str(target).rpartition(".")
    try:
        module = importlib.import_module(module_name)
    except Exception:  # noqa: BLE001 - the module itself is the problem
        cause = err.__cause__ or err
        return " ".join(str(cause).split()).split(" Are you sure")[0]
    close = difflib.get_close_matches(name, [n for n in dir(module) if not n.startswith("_")], n=1)
    return f"{module_name} has no {name!r}" + (f"; did you mean '{module_name}.{close[0]}'?" if close else "")


_NUMBER_ANNOTATION_NAMES = {"int", "float", "None", "Optional", "Union", "Tensor"}


def _wants_number(param: inspect.Parameter) -> bool:
    """The parameter takes a number and nothing else: annotated int or float, alone or in a union
    with None or a Tensor (torch's `lr: float | Tensor`), or unannotated with a number as default.
    Not `str | int` (an EMA interval: `10ba` or 10), nor a tuple of floats (AdamW's betas)."""
    annotation = param.annotation
    if annotation is inspect.Parameter.empty:
        return isinstance(param.default, int | float) and not isinstance(param.default, bool)
    if isinstance(annotation, str):  # under `from __future__ import annotations`: the names in it
        names = set(re.findall(r"[A-Za-z_]\w*", annotation))
        return bool(names & {"int", "float"}) and names <= _NUMBER_ANNOTATION_NAMES
    options = (
        typing.get_args(annotation)
        if typing.get_origin(annotation) in (typing.Union, types.UnionType)
        else (annotation,)
    )
    options = [o for o in options if o is not type(None)]
    numbers = [o for o in options if o in (int, float)]
    return bool(numbers) and all(o in (int, float) or getattr(o, "__name__", "") == "Tensor" for o in options)


def _check_max_duration(trainer: dict) -> None:
    """Composer parses `max_duration` only when the Trainer is built, after the model and data, and
    a zero one ends in "pass reset_time=True to Trainer.fit()", which the CLI cannot."""
    from composer.core import Time, TimeUnit

    value = trainer.get("max_duration")
    if value is None:
        return
    example = "e.g. 550000ba (batches), 1000000sp (samples) or 2ep (epochs)"
    try:
        duration = Time.from_input(value, TimeUnit.EPOCH)  # a bare int means epochs, as in Composer
    except (ValueError, TypeError) as err:
        raise ConfigError(f"'trainer.max_duration' must be a duration, {example}; got {value!r}") from err
    if duration.unit == TimeUnit.DURATION:  # a fraction of itself
        raise ConfigError(f"'trainer.max_duration' cannot be in dur, {example}; got {value!r}")
    if duration.value <= 0:
        raise ConfigError(f"'trainer.max_duration' must be more than zero, {example}; got {value!r}")


def _check_values(run: RunConfig) -> None:
    """Build the optimizer (over a stand-in parameter), the scheduler, every callback and algorithm
    once and drop them, so that a value their constructors refuse (`callbacks.samples.sampler=foo`,
    `optimizer.lr=-1`) is a config error before anything is built, not a traceback after the model,
    the data or thousands of batches. Their constructors are cheap and build nothing large. Not the
    loggers: theirs may start a run (wandb) or open a tracking store (MLflow)."""
    import torch

    _build_once(run.optimizer, "optimizer", params=[torch.nn.Parameter(torch.zeros(1))])
    if run.scheduler is not None:
        _build_once(run.scheduler, "scheduler")
    for section in ("algorithms", "callbacks"):
        for name, spec in getattr(run, section).items():
            _build_once(spec, f"{section}.{name}")


def _build_once(spec: dict, where: str, **supplied) -> None:
    from hydra.errors import InstantiationException
    from hydra.utils import instantiate

    try:
        instantiate(spec, **supplied)
    except Exception as err:  # noqa: BLE001 - whatever a constructor raises, the config gave it the value
        cause = err
        while isinstance(cause, InstantiationException) and cause.__cause__ is not None:
            cause = cause.__cause__  # Hydra wraps the constructor's error, with its own traceback text
        message = " ".join(str(cause).split()) or type(cause).__name__
        names = "|".join(re.escape(k) for k in spec if not k.startswith("_"))
        if names and re.match(rf"({names})=", message):  # the constructor named its argument
            raise ConfigError(f"{where}.{message}") from err
        raise ConfigError(f"'{where}' ({spec['_target_']}): {message}") from err


def check_device(run: RunConfig) -> None:
    """The device, precision and optimizer this machine can run, and a save folder the run would
    collide with (recipes/checks.py); called before anything is built."""
    _refuse(device_problem(run.trainer, run.optimizer))
    _refuse(save_folder_problem(run.trainer, run.run_name))


def _refuse(problem: str | None) -> None:
    """Raise the problem one of recipes/checks.py's checks found, if any."""
    if problem is not None:
        raise ConfigError(problem)
