"""Train Stable Diffusion: `composer train.py yamls/RUN.yaml [key=value ...]` (or `python train.py ...`)."""

import logging
import sys

from common.secrets import install_log_redaction
from recipes import ConfigError, load_config, train


def main(argv: list[str]) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    install_log_redaction()
    if not argv:
        sys.exit("usage: train.py yamls/RUN.yaml [key=value ...]")
    try:
        train(load_config(argv[0], argv[1:]))
    except ConfigError as err:
        sys.exit(f"config error: {err}")


if __name__ == "__main__":
    main(sys.argv[1:])
