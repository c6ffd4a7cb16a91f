"""DreamBooth (`dreambooth:` in a run config): fine-tune on a few images of one subject, captioned with
one instance prompt ("a photo of sks dog"), optionally with prior preservation: images of the class
("a photo of a dog") drawn once by the base model (recipes/class_images.py) and trained on beside
them, their loss weighted by `prior_loss_weight` (models/engine/prior_loss.py), as diffusers'
examples/dreambooth/train_dreambooth*.py do (`--instance_data_dir`, `--instance_prompt`,
`--with_prior_preservation`, `--class_data_dir`, `--class_prompt`, `--num_class_images`,
`--prior_loss_weight`).

`prepare_dreambooth` (build_trainer calls it before the data are checked) writes each folder as an
MDS set under `data_dir` (the image files as they are, the prompt as every caption, a `prior` column),
named by a hash of the images and the prompt, so a changed folder makes a new set and an unchanged one
is reused; then it points `data.train` at them: one stream, or two of equal proportion batched
`stratified`, so every batch holds as many class images as instance images (diffusers' pairs).
The user's folders are only read.
"""

import dataclasses
import fcntl
import hashlib
import logging
from dataclasses import dataclass
from pathlib import Path

from PIL import Image, UnidentifiedImageError

from common.atomic import atomic_path
from convert.common import BASE_COLUMNS
from convert.folder import IMAGE_SUFFIXES
from recipes.class_images import images_in, make_class_images

log = logging.getLogger(__name__)

COLUMNS = {**BASE_COLUMNS, "prior": "int32"}  # models/engine/prior_loss.py PRIOR
PRIOR_SHARE = 0.5  # class images' share of every global batch: diffusers' 1 + 1 pairs


@dataclass
class DreamBoothConfig:
    """`dreambooth:` in the run YAML (yamls/*-dreambooth.yaml)."""

    instance_dir: str  # the subject's images (only read)
    instance_prompt: str  # the caption of every one of them, e.g. "a photo of sks dog"
    with_prior_preservation: bool = False
    class_prompt: str | None = None  # e.g. "a photo of a dog"
    class_dir: str | None = None  # class images: the user's, or drawn there by the base model
    num_class_images: int = 100  # diffusers' default
    prior_loss_weight: float = 1.0  # loss = instance + prior_loss_weight * prior
    # How the base model draws the missing class images (recorded in class_dir's manifest).
    class_steps: int = 25
    class_guidance: float = 5.0
    class_batch_size: int = 4
    class_seed: int = 0
    data_dir: str | None = None  # where the MDS sets go; default runs/<run_name>/dreambooth

    def __post_init__(self):
        if not str(self.instance_prompt).strip():
            raise ValueError("instance_prompt must be a caption, e.g. 'a photo of sks dog'; it is empty")
        if not self.prior_loss_weight >= 0:
            raise ValueError(f"prior_loss_weight must be 0 or more, got {self.prior_loss_weight}")
        for key in ("num_class_images", "class_steps", "class_batch_size"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{key} must be a positive integer, got {value!r}")
        if not self.class_guidance >= 0:
            raise ValueError(f"class_guidance must be 0 or more, got {self.class_guidance}")
        if self.with_prior_preservation:
            for key in ("class_prompt", "class_dir"):
                if not getattr(self, key):
                    raise ValueError(
                        f"{key} must be set with with_prior_preservation: true (class_prompt: the class's "
                        "caption, e.g. 'a photo of a dog'; class_dir: a folder for its images)"
                    )


def config_problem(db: DreamBoothConfig | None, data_train, global_batch: int) -> str | None:
    """A data.train that DreamBooth cannot fill in, or a batch it cannot halve (parse_config refuses
    them before anything is built)."""
    if db is None:
        return None
    if db.with_prior_preservation and global_batch % 2:
        return (
            f"global_train_batch_size={global_batch} must be even with dreambooth.with_prior_preservation: "
            "every batch is half instance, half class images"
        )
    named = [k for k in ("local", "remote", "streams") if getattr(data_train, k) is not None]
    if named:
        return (
            f"data.train.{named[0]} is set, but dreambooth makes data.train's sets from "
            "dreambooth.instance_dir (and class_dir); remove data.train." + named[0]
        )
    if data_train.latents or data_train.buckets or data_train.prepare is not None:
        key = "latents" if data_train.latents else "buckets" if data_train.buckets else "prepare"
        return f"data.train.{key} does not apply to dreambooth's image folders; remove it"
    return None


def instance_images(db: DreamBoothConfig) -> list[Path]:
    folder = Path(db.instance_dir)
    if not folder.is_dir():
        raise ValueError(f"dreambooth.instance_dir={folder} does not exist (the subject's images)")
    images = images_in(folder)
    if not images:
        raise ValueError(
            f"dreambooth.instance_dir={folder} holds no images ({', '.join(sorted(IMAGE_SUFFIXES))})"
        )
    return images


def prepare_dreambooth(run, device: str = "cpu"):
    """`run` (a RunConfig with `dreambooth`) with data.train pointing at MDS sets of the instance
    images and, with prior preservation, the class images (drawn first where missing). Both folders
    are checked before anything is written."""
    db = run.dreambooth
    data_dir = Path(db.data_dir or Path("runs", run.run_name, "dreambooth"))
    subject = [_row(path, db.instance_prompt, 0, "instance_dir") for path in instance_images(db)]
    if not db.with_prior_preservation:
        instance = _mds(subject, data_dir / "instance")
        run.data.train = dataclasses.replace(run.data.train, local=str(instance))
        return run
    data_dir.mkdir(parents=True, exist_ok=True)
    with open(data_dir / ".class-images.lock", "w") as lock:
        # Launched ranks queue here: one draws the missing images, the rest find them made.
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, also if the process dies
        classes = make_class_images(db, run.model, run.data.train.resolution, device)
    prior = _mds([_row(path, db.class_prompt, 1, "class_dir") for path in classes], data_dir / "class")
    instance = _mds(subject, data_dir / "instance")
    streams = {"instance": {"local": str(instance), "proportion": 1 - PRIOR_SHARE}}
    streams["class"] = {"local": str(prior), "proportion": PRIOR_SHARE}
    run.data.train = dataclasses.replace(run.data.train, streams=streams, batching_method="stratified")
    return run


def _mds(rows: list[dict], prefix: Path) -> Path:
    """An MDS set of `rows` at `prefix-<hash of their content>` (made unless there already), so a
    changed folder or prompt makes a new set and an unchanged one is reused."""
    from convert.mds import write_mds

    digest = hashlib.blake2b(digest_size=8)
    for row in rows:
        digest.update(f"{row['key']}\0{row['caption']}\0{row['prior']}\0".encode())
        digest.update(row["image"])
    out = prefix.with_name(f"{prefix.name}-{digest.hexdigest()}")
    if (out / "index.json").is_file():
        return out
    with atomic_path(out, existing="keep") as tmp:
        write_mds(rows, str(tmp), COLUMNS)
    return out


def _row(path: Path, prompt: str, prior: int, key: str) -> dict:
    try:
        with Image.open(path) as image:
            image.verify()
            width, height = image.size
    except (OSError, UnidentifiedImageError) as err:
        raise ValueError(f"dreambooth.{key}: {path} is not an image that can be read ({err})") from err
    return {
        "image": path.read_bytes(),
        "caption": prompt,
        "width": width,
        "height": height,
        "original_width": width,
        "original_height": height,
        "key": path.stem,
        "prior": prior,
    }
