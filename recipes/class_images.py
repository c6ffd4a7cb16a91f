"""DreamBooth's class images: made once with the base model, kept in `class_dir`, reused on rerun.

`class_dir` may hold images the user put there: they count, and are never overwritten or moved.
When fewer than `num_class_images` are there, the base model draws the rest (`class-NNNNN.png`, the
image of index i from seed `class_seed + i`, so a run killed halfway and rerun makes the very images
an uninterrupted run would have made). Each image is written to a hidden temporary file and
hard-linked to its name, which fails rather than replace a file that appeared meanwhile.

`class_images.json` beside them says what made them (prompt, base model, seed, size, steps,
guidance). A rerun whose prompt or base model differs refuses in one line: mixing two priors in one
folder would be a silent mistake.
"""

import gc
import json
import logging
import os
from pathlib import Path

import torch
from tqdm import tqdm

from common.atomic import atomic_path, temporary_sibling
from convert.folder import IMAGE_SUFFIXES

log = logging.getLogger(__name__)

MANIFEST = "class_images.json"
# What the class images are of: a rerun must not mix two priors in one folder. (Another seed, size or
# number of steps draws other pictures of the same prior; the manifest records the latest.)
IDENTITY_KEYS = ("prompt", "base")


def images_in(folder: str | Path) -> list[Path]:
    """The images of `folder` (not its subfolders), sorted; hidden files (our temporaries) left out."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    return sorted(
        p
        for p in folder.iterdir()
        if p.is_file() and not p.name.startswith(".") and p.suffix.lower() in IMAGE_SUFFIXES
    )


def base_identity(model_options: dict) -> dict | None:
    """The base model the class images come from ({preset, pretrained}), or None when the run has
    none: no `model.pretrained`, or a denoiser not loaded from it (class images from a randomly
    initialised network would teach the model noise as its prior)."""
    pretrained = model_options.get("pretrained")
    if pretrained is None:
        return None
    components = model_options.get("pretrained_components")
    if components is not None and not {"unet", "transformer"} & set(components):
        return None
    local = Path(pretrained).expanduser()
    source = str(local.resolve()) if local.exists() else str(pretrained)  # a hub id stays as given
    return {"preset": model_options["preset"], "pretrained": source}


def read_manifest(class_dir: Path) -> dict | None:
    path = class_dir / MANIFEST
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise ValueError(f"dreambooth.class_dir: {path} is not readable JSON ({err}); remove it") from err


def check_manifest(class_dir: Path, wanted: dict) -> None:
    """Refuse, in one line, class images made for another prompt or base model."""
    made = read_manifest(class_dir)
    if made is None:
        return
    differ = [k for k in IDENTITY_KEYS if made.get(k) != wanted[k]]
    if differ:
        key = differ[0]
        raise ValueError(
            f"dreambooth.class_dir={class_dir} holds class images made with {key}={made.get(key)!r}, "
            f"this run asks for {key}={wanted[key]!r}; use another class_dir, or remove that folder "
            "to make them anew"
        )


def write_manifest(class_dir: Path, manifest: dict) -> None:
    with atomic_path(class_dir / MANIFEST) as tmp:
        tmp.write_text(json.dumps(manifest, indent=2) + "\n")


def missing_class_images(class_dir: str | Path, wanted: int) -> int:
    return max(0, wanted - len(images_in(class_dir)))


def make_class_images(db, model_options: dict, resolution: int, device: str) -> list[Path]:
    """Ensure `db.class_dir` holds `db.num_class_images` images (`db`: the run's DreamBoothConfig),
    drawing the missing ones with the base model; return the first `num_class_images` of them."""
    class_dir = Path(db.class_dir)
    base = base_identity(model_options)
    wanted = {"prompt": db.class_prompt, "base": base, "seed": db.class_seed, "resolution": resolution}
    check_manifest(class_dir, wanted)
    missing = missing_class_images(class_dir, db.num_class_images)
    if missing:
        if base is None:
            raise ValueError(
                f"dreambooth: class images missing: class_dir={class_dir} holds "
                f"{len(images_in(class_dir))} of num_class_images={db.num_class_images}, and there is no "
                "base model to make the rest (model.pretrained, with its denoiser); put the images "
                "there, lower num_class_images, or set model.pretrained"
            )
        class_dir.mkdir(parents=True, exist_ok=True)
        manifest = {**wanted, "count": db.num_class_images, "steps": db.class_steps}
        manifest["guidance"] = db.class_guidance
        write_manifest(class_dir, manifest)  # first: a killed run's images are known to be ours
        _generate(db, model_options, class_dir, missing, resolution, device)
    images = images_in(class_dir)[: db.num_class_images]
    log.info("dreambooth: %d class images of %r in %s", len(images), db.class_prompt, class_dir)
    return images


def _free_names(class_dir: Path, count: int) -> list[tuple[int, Path]]:
    """The first `count` indices i whose class-i.png is not there (a partial run's are)."""
    names, i = [], 0
    while len(names) < count:
        path = class_dir / f"class-{i:05d}.png"
        if not path.exists():
            names.append((i, path))
        i += 1
    return names


@torch.no_grad()
def _generate(db, model_options: dict, class_dir: Path, count: int, resolution: int, device: str) -> None:
    from torchvision.transforms.functional import to_pil_image

    from models import build

    log.info("dreambooth: drawing %d class images of %r with the base model", count, db.class_prompt)
    model = build(**model_options).to(device).eval()
    todo = _free_names(class_dir, count)
    with tqdm(total=count, desc="class images", unit="image") as bar:
        for start in range(0, len(todo), db.class_batch_size):
            chunk = todo[start : start + db.class_batch_size]
            images = model.generate(
                [db.class_prompt] * len(chunk),
                guidance_scale=db.class_guidance,
                num_inference_steps=db.class_steps,
                height=resolution,
                width=resolution,
                seeds=[db.class_seed + i for i, _ in chunk],
            )
            for (_, path), image in zip(chunk, images):
                _publish_png(to_pil_image(image.float().clamp(0, 1).cpu()), path)
            bar.update(len(chunk))
    del model  # the training model is built afresh from the same options: free this one's memory first
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _publish_png(image, path: Path) -> None:
    """Write `path` whole or not at all, and never over a file that is already there."""
    tmp = temporary_sibling(path)
    image.save(tmp, format="PNG")
    try:
        os.link(tmp, path)  # fails with FileExistsError instead of replacing
    except FileExistsError:
        log.warning("dreambooth: %s appeared while it was drawn; kept the one there", path)
    finally:
        tmp.unlink(missing_ok=True)
