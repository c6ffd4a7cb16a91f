"""Train Stable Diffusion: `composer train.py yamls/RUN.yaml [key=value ...]` (or `python train.py ...`)."""

import logging
import os
import sys

USAGE = """usage: train.py yamls/RUN.yaml [key=value ...]

  key=value   set a config key (e.g. trainer.max_duration=100ba, data.train.local=runs/data/mine);
              +key=value adds a key the recipe lacks, ~key removes one; each key at most once.
  A rerun of the same command continues from the newest checkpoint in trainer.save_folder.
  Recipes: yamls/*.yaml; docs/training.md explains the keys."""


def main(argv: list[str]) -> None:
    # Imported here, not at the top: Composer starts some helpers with `spawn` (MLflow's run monitor;
    # a RemoteUploaderDownloader given use_procs=True), and a spawned process imports this script
    # first; with these imports at the top each helper would load the whole stack (~7 s of CPU).
    from common.lifetime import end_with_launcher
    from common.secrets import install_log_redaction
    from recipes import ConfigError, check_overrides, load_config, train

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # Checkpoints upload from threads of this process (compat.composer.upload_in_threads), and each
    # upload makes its own S3 client, which says where it found credentials: twice a checkpoint.
    logging.getLogger("botocore.credentials").setLevel(logging.WARNING)
    install_log_redaction()
    end_with_launcher()  # a SIGKILLed `composer -n N` takes its ranks with it
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip() + "\n\n" + USAGE)
        sys.exit(0 if argv else 2)
    try:
        check_overrides(argv[1:])
        train(load_config(argv[0], argv[1:]))
    except ConfigError as err:
        # Every rank reads the same config and makes the same checks (decisions one rank makes are
        # broadcast), so rank 0 says it once; the others end quietly and cleanly, and `composer -n N`
        # then reports rank 0's exit instead of each rank's copy of the line under its own banner.
        if os.environ.get("RANK", "0") != "0":
            sys.exit(0)
        sys.exit(f"config error: {err}")


if __name__ == "__main__":
    main(sys.argv[1:])
