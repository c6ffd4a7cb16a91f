"""Make a recipe's pretrained folder on first use by running the recipe that writes it.

yamls/tiny-cpu.yaml loads its VAE from runs/tiny-vae/export, which yamls/tiny-vae.yaml writes. So
`python train.py yamls/tiny-cpu.yaml` works on a fresh checkout, the first run trains the VAE (about
a minute on a CPU) in a subprocess. Launched ranks queue on a file lock: one trains, the rest find
the folder made. The subprocess runs without the launcher's distributed variables, as one process.
"""

import fcntl
import logging
import os
import subprocess
import sys
from pathlib import Path

from recipes.config import ConfigError

log = logging.getLogger(__name__)

ENTRY = Path(__file__).resolve().parents[1] / "train.py"
# Set by the composer launcher; the preparing run must not join the job's process group.
DIST_VARIABLES = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "NODE_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
)


def prepare_pretrained(folder: str | None, recipe: str) -> None:
    """Run `python train.py RECIPE` unless `folder` exists; it must write `folder`."""
    if folder is None or Path(folder).exists():
        return
    if not Path(recipe).is_file() and (ENTRY.parent / recipe).is_file():
        recipe = str(ENTRY.parent / recipe)  # a repo path like yamls/tiny-vae.yaml, run from elsewhere
    if not Path(recipe).is_file():
        raise ConfigError(f"prepare_pretrained: no recipe at {recipe} (to write model.pretrained={folder})")
    lock_path = Path(folder).parent / f".{Path(folder).name}.lock"
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, also if this process dies
        if Path(folder).exists():  # another rank made it while this one waited
            return
        log.info("model.pretrained=%s is missing: running %s to make it", folder, recipe)
        env = {k: v for k, v in os.environ.items() if k not in DIST_VARIABLES}
        done = subprocess.run([sys.executable, str(ENTRY), recipe], env=env)
        if done.returncode != 0:
            raise ConfigError(
                f"prepare_pretrained: {recipe} failed (exit {done.returncode}); see its output above"
            )
        if not Path(folder).exists():
            raise ConfigError(f"prepare_pretrained: {recipe} finished but wrote no {folder}")
