"""Make what a run needs on first use: its dataset (`data.train.prepare`) and its pretrained folder.

`data.train.prepare: shapes` builds the synthetic shapes as MDS at `data.train.local` (drawn by
data/synthetic.py, converted by our own `sd-convert folder`) when it is not there yet.

`prepare_pretrained`: yamls/tiny-cpu.yaml loads its VAE from runs/tiny-vae/export, which
yamls/tiny-vae.yaml writes. So `python train.py yamls/tiny-cpu.yaml` works on a fresh checkout, the
first run trains the VAE (about 2 minutes on 2 idle cores) in a subprocess. Launched ranks queue on a file
lock: one trains, the rest find the folder made. The subprocess runs without the launcher's
distributed variables, as one process.
"""

import fcntl
import logging
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from common.atomic import atomic_path
from convert.__main__ import main as sd_convert
from convert.mds import write_mds
from data.loader import ImageCaptionDataConfig, bucket_sizes
from data.streams import resolve_streams
from data.synthetic import NEW_SHAPES, SHAPES, write_shapes_folder
from recipes.config import ConfigError
from recipes.data_checks import local_problem

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
    writes = pretrained_folder_of(recipe)
    if writes is None or Path(writes).resolve() != Path(folder).resolve():
        # A typo in model.pretrained: running the recipe would write (over) its own folder, not this one.
        raise ConfigError(
            f"model.pretrained={folder} does not exist (prepare_pretrained runs {recipe}, which writes "
            f"{writes}); fix the path, or set model.pretrained={writes}"
        )
    lock_path = Path(folder).parent / f".{Path(folder).name}.lock"
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, also if this process dies
        if Path(folder).exists():  # another rank made it while this one waited
            return
        log.info("model.pretrained=%s is missing: running %s to make it (progress below)", folder, recipe)
        env = {k: v for k, v in os.environ.items() if k not in DIST_VARIABLES}
        done = subprocess.run([sys.executable, str(ENTRY), recipe], env=env)
        if done.returncode != 0:
            raise ConfigError(
                f"prepare_pretrained: {recipe} failed (exit {done.returncode}); see its output above"
            )
        if not Path(folder).exists():
            raise ConfigError(f"prepare_pretrained: {recipe} finished but wrote no {folder}")


def pretrained_folder_of(recipe: str) -> str | None:
    """The pipeline folder `recipe` writes: its `callbacks.save_pretrained.folder`."""
    from recipes.compose import load_config

    callbacks = load_config(recipe).get("callbacks") or {}
    spec = callbacks.get("save_pretrained") or {}
    return spec.get("folder")


# 2,048 images: about 170 per (colour, shape) pair, at random places and sizes, so the demo's
# models learn the concepts rather than memorise a few pictures.
def prepare_shapes_mds(
    local: str | Path, n: int = 2048, size: int = 32, seed: int = 0, shapes: tuple[str, ...] = SHAPES
) -> Path:
    """Make the shapes dataset (of `shapes`) as MDS at `local` unless it is already there: an image
    folder converted by our own converter (`sd-convert folder`).

    Safe when several ranks call it at once: each builds in its own temporary folders and renames
    the MDS into place; the first rename wins and the data are identical anyway (fixed seed).
    """
    local = Path(local)
    if (local / "index.json").exists():
        return local
    with (
        atomic_path(local, existing="keep") as out,
        tempfile.TemporaryDirectory(prefix=f".tmp-{local.name}-src-", dir=local.parent) as scratch,
    ):
        images = write_shapes_folder(Path(scratch, "images"), n=n, size=size, seed=seed, shapes=shapes)
        argv = ["folder", "--src", str(images), "--out", str(out), "--work-dir", str(Path(scratch, "work"))]
        if sd_convert(argv) != 0:
            raise RuntimeError(f"sd-convert {' '.join(argv)} failed (see the log above)")
    if not (local / "index.json").exists():  # "keep" kept a folder that another process left there
        raise FileExistsError(f"{local} exists but holds no MDS dataset (no index.json); remove it")
    return local


def prepare_cross_mds(local: str | Path, n: int = 768) -> Path:
    """The demo's LoRA concept (yamls/tiny-lora-concept-cpu.yaml): a third of the images a cross
    (NEW_SHAPES, never in the base set) in the four colours, the rest the base shapes, so that the
    adapter learns the new word without drifting on the old prompts (DreamBooth's prior preservation,
    with real images of the old prompts in place of the base model's samples; with half crosses the
    old prompts lost 11 points of shape accuracy). Another seed than the base set's."""
    return prepare_shapes_mds(local, n=n, seed=2, shapes=NEW_SHAPES * len(SHAPES) + SHAPES * 2)


def prepare_random_latents(
    local: str | Path,
    preset: str = "sd2-base",
    n: int = 512,
    resolutions=(256, 512),
    seed: int = 0,
    t5: bool = False,
) -> Path:
    """Random precomputed latents shaped like `preset`'s (`convert latents` columns: VAE moments at
    each resolution and the stored form of a caption, whose names and shapes the family's conditioner
    gives (models/stored_form.py: the text context, a pooled vector, with `t5` an optional T5's
    context); SDXL's micro-conditioning too), for GPU throughput and wiring checks (bench/gpu/gpu_check.py)
    where the data's content does not matter and a VAE pass would be wasted. Made once; safe when
    several ranks call it at once (as prepare_shapes_mds)."""
    import numpy as np

    from convert.latents import preset_columns
    from models.presets import vae_factor
    from models.registry import PRESETS, of
    from models.stored_form import stored_shapes

    local = Path(local)
    if (local / "index.json").exists():
        return local
    spec, family = PRESETS[preset], of(preset)
    cols = preset_columns(preset, list(resolutions), t5)
    text = stored_shapes(preset, t5)
    if missing := set(text) - set(cols):  # the conditioner and convert.latents disagree: a bug, not input
        raise AssertionError(f"{preset}: stored-form tensors {sorted(missing)} have no column {sorted(cols)}")
    channels, factor = spec["vae"]["latent_channels"], vae_factor(preset)
    # Unscaled latents that the model's scaling brings to about unit variance: SD's mean ~ 5 N(0, 1)
    # (scale 0.18215; SDXL's kept the same), a VAE with a shift (SD3's, Flux's): shift + N(0, 1) / scale.
    std, shift = (1 / spec["latent_scale"], spec["latent_shift"]) if "latent_shift" in spec else (5.0, 0.0)
    rng = np.random.default_rng(seed)

    def rows():
        for i in range(n):
            row = {"caption": "", "key": str(i)}
            draw = lambda name: rng.standard_normal(text[name], np.float32).astype(np.float16)  # noqa: E731
            row["text_embeds"] = draw("text_embeds")  # first, then the latents: the draws made before
            for r in resolutions:
                mean = rng.standard_normal((channels, r // factor, r // factor), np.float32) * std + shift
                row[f"latents_{r}"] = np.concatenate([mean, np.full_like(mean, -6.0)]).astype(np.float16)
            row.update({name: draw(name) for name in text if name != "text_embeds"})
            if family.micro_conditioning:
                row["original_size"] = np.array([max(resolutions)] * 2, dtype=np.int64)
                row.update({f"crop_top_left_{r}": np.zeros(2, dtype=np.int64) for r in resolutions})
            yield row

    with atomic_path(local, existing="keep") as out:
        write_mds(rows(), str(out), cols)
    return local


def prepare_sd2_latents(local: str | Path, n: int = 512, resolutions=(256, 512)) -> Path:
    return prepare_random_latents(local, "sd2-base", n, resolutions)


def prepare_sdxl_latents(local: str | Path, n: int = 256, resolutions=(512, 1024)) -> Path:
    return prepare_random_latents(local, "sdxl-base", n, resolutions)


def prepare_sd3_latents(local: str | Path, n: int = 512, resolutions=(256, 512)) -> Path:
    """sd3-medium's, without T5 (off by default): 16-channel moments, the CLIP context and pooled vector."""
    return prepare_random_latents(local, "sd3-medium", n, resolutions)


def prepare_flux_latents(local: str | Path, n: int = 512, resolutions=(256,)) -> Path:
    """flux-schnell's at MLPerf's 256 px: 16-channel moments, T5's 256-token context, CLIP's pooled vector."""
    return prepare_random_latents(local, "flux-schnell", n, resolutions)


# Datasets that `data.train.prepare: NAME` builds at `data.train.local` when it is missing.
PREPARERS = {
    "shapes": prepare_shapes_mds,
    "shapes-cross": prepare_cross_mds,
    "sd2-latents": prepare_sd2_latents,
    "sdxl-latents": prepare_sdxl_latents,
    "sd3-latents": prepare_sd3_latents,
    "flux-latents": prepare_flux_latents,
}


def ensure_dataset(cfg: ImageCaptionDataConfig, size_multiple: int = 64, key: str = "data") -> None:
    """Build the dataset if the config names a preparer, else check that every set it names holds
    samples (reading each index.json, downloading it for a remote) and that bucket sizes fit the
    model (multiples of `size_multiple`).

    Called before the model is built, so a wrong path, an unreachable or empty stream or a bad
    bucket size fails in a second, not after a minute. `key`: where `cfg` sits in the run config
    (`data.train`), which the messages name (build_trainer makes them a ConfigError).
    """
    if cfg.streams is None and cfg.local is None and cfg.remote is None:
        raise ValueError(
            f"{key}: set `local` (an MDS folder) and/or `remote` (e.g. s3://bucket/prefix), or `streams`"
        )
    if cfg.prepare is not None:
        if cfg.local is None:
            raise ValueError(f"{key}.prepare={cfg.prepare!r} writes to `local`; set {key}.local to a folder")
        if cfg.prepare not in PREPARERS:
            raise ValueError(f"{key}.prepare={cfg.prepare!r} is not one of {sorted(PREPARERS)}")
        if Path(cfg.local).exists() and (problem := local_problem(key, cfg.local)):
            raise ValueError(problem)  # the user's own folder (photos, say): never build into it
        if not Path(cfg.local, "index.json").exists():
            log.warning(
                "%s.local=%s is missing: making the synthetic %r set there (%s.prepare=%s; set it to "
                "null to train on your own data)", key, cfg.local, cfg.prepare, key, cfg.prepare,
            )  # fmt: skip
        PREPARERS[cfg.prepare](cfg.local)
    elif cfg.streams is None and cfg.remote is None and not Path(cfg.local, "index.json").exists():
        raise FileNotFoundError(local_problem(key, cfg.local))
    if cfg.streams is not None or cfg.buckets or cfg.remote is not None:
        specs = resolve_streams(cfg)
        if cfg.buckets:
            bucket_sizes(cfg, {s.bucket for s in specs}, size_multiple)
