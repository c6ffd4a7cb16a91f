"""From a recipe YAML and a command line to one composed config: `load_config` composes the YAML
with Hydra (the YAML's folder is the config dir, so defaults lists work) and applies the dotlist
overrides; `check_overrides` refuses a key given twice on a user's command line; a data set named on
the command line turns the recipe's synthetic-data `prepare` off. recipes/config.py then checks the
result against the run schema.
"""

import os
from pathlib import Path

import yaml
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException, OverrideParseException
from omegaconf import DictConfig

from recipes.config import ConfigError


def load_config(yaml_path: str | Path, overrides: list[str] = ()) -> DictConfig:
    """Compose `yaml_path` with Hydra and apply dotlist overrides (`a.b=c`, `+a=b`, `~a`)."""
    path = Path(yaml_path).resolve()
    if not path.is_file():
        raise ConfigError(f"config file {yaml_path} does not exist")
    groups = {p.name for p in path.parent.iterdir() if p.is_dir()}
    # `++key=value` adds or sets, so a key the YAML leaves at its default can still be overridden;
    # unknown keys are caught by parse_config with a clearer message than Hydra's struct error.
    hydra_overrides = [o if o[:1] in "+~" or o.split("=", 1)[0] in groups else f"++{o}" for o in overrides]
    try:
        with initialize_config_dir(config_dir=str(path.parent), version_base=None):
            cfg = compose(config_name=path.stem, overrides=hydra_overrides)
    except (ConfigCompositionException, OverrideParseException) as err:
        raise ConfigError(f"{path.name}: {err}") from err
    except yaml.YAMLError as err:  # the YAML itself, or one in its defaults list, does not parse
        raise ConfigError(_yaml_error(err)) from err
    _own_data_only(cfg, overrides)
    return cfg


def _override_key(override: str) -> str:
    return override.split("=", 1)[0].lstrip("+~")


def check_overrides(overrides) -> None:
    """One key given twice on the command line is a mistake (which one did the user mean?), not
    last-wins. train.py checks a user's command line; code composing overrides may layer them."""
    seen: dict[str, str] = {}
    for override in overrides:
        key = _override_key(override)
        if key in seen:
            raise ConfigError(
                f"'{key}' is given twice on the command line ({seen[key]} and {override}); keep one"
            )
        seen[key] = override


def _own_data_only(cfg: DictConfig, overrides) -> None:
    """A set named on the command line is the user's own: the recipe's `prepare` (synthetic data it
    makes on first use) does not apply to it unless the command line names a preparer too, so a typo
    in `data.train.local=...` is "does not exist", not a run on 2,048 synthetic shapes."""
    keys = {_override_key(o) for o in overrides}
    data = cfg.get("data") if isinstance(cfg, DictConfig) else None
    for split in ("train", "eval"):
        section = data.get(split) if data is not None else None
        if not isinstance(section, DictConfig) or section.get("prepare") is None:
            continue
        named = {f"data.{split}.{k}" for k in ("local", "remote", "streams")} & keys
        if named and f"data.{split}.prepare" not in keys:
            section.prepare = None


def _yaml_error(err: yaml.YAMLError) -> str:
    """One line: `FILE, line L, column C: PROBLEM (CONTEXT at line L, column C)`, 1-based as editors
    count (PyYAML's marks are 0-based)."""
    mark = getattr(err, "problem_mark", None)
    if mark is None:
        return f"invalid YAML: {' '.join(str(err).split())}"
    name = os.path.relpath(mark.name)  # as the user gave it, when it is under the working directory
    name = mark.name if name.startswith("..") else name
    message = f"{name}, line {mark.line + 1}, column {mark.column + 1}: invalid YAML: {err.problem}"
    context, at = getattr(err, "context", None), getattr(err, "context_mark", None)
    if context and at is not None:
        message += f" ({context} at line {at.line + 1}, column {at.column + 1})"
    return message
