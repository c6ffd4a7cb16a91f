"""Train Stable Diffusion: `composer train.py yamls/RUN.yaml [key=value ...]` (or `python train.py ...`)."""

import logging
import sys


def main(argv: list[str]) -> None:
    # Imported here, not at the top: Composer starts its remote-upload helpers with `spawn`, and a
    # spawned process imports this script first; with these imports at the top each helper would
    # load the whole stack (~7 s of CPU) for nothing.
    from common.secrets import install_log_redaction
    from recipes import ConfigError, load_config, train

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
