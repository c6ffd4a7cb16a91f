"""The training recipe: config, trainer building, algorithms and callbacks."""

from recipes.compose import check_overrides, load_config
from recipes.config import ConfigError, parse_config
from recipes.trainer import build_trainer, train

__all__ = ["ConfigError", "check_overrides", "build_trainer", "load_config", "parse_config", "train"]
