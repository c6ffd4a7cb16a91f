"""The training recipe: config, trainer building, algorithms and callbacks."""

import compat.torchao  # noqa: F401  (first: quiets what importing torchao logs; compat/torchao.py)
from recipes.compose import check_overrides, load_config
from recipes.config import ConfigError, parse_config
from recipes.trainer import build_trainer, train

__all__ = ["ConfigError", "check_overrides", "build_trainer", "load_config", "parse_config", "train"]
