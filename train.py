"""Train Stable Diffusion: `composer train.py yamls/RUN.yaml [key=value ...]` (or `python train.py ...`)."""

import logging
import sys

from recipes import ConfigError, load_config, train
from recipes.secrets import install_log_redaction

if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    install_log_redaction()
    if len(sys.argv) < 2:
        sys.exit("usage: train.py yamls/RUN.yaml [key=value ...]")
    try:
        cfg = load_config(sys.argv[1], sys.argv[2:])
        train(cfg)
    except ConfigError as err:
        sys.exit(f"config error: {err}")
