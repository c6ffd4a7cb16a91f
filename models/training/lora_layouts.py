"""The two layouts `models.export --lora` writes a LoRA in, each read back with diffusers and compared
with the adapter before it is put in place (issue 51):

- diffusers / peft, `pytorch_lora_weights.safetensors`: the family pipeline's own save_lora_weights
  (models/training/lora.py save_lora), rank and alpha in its metadata; `Pipeline.load_lora_weights(DIR)`
  reads it.
- kohya / ComfyUI, `<name>_kohya.safetensors`: kohya sd-scripts' names, `lora_down` / `lora_up` and an
  `alpha` per module (the scale is alpha / lora_down's rows, which every reader of the layout applies);
  ComfyUI, AUTOMATIC1111 / Forge and kohya's tools load it, and diffusers' `load_lora_weights(FILE)`
  through its converters. The family's key map is its declaration's `lora_kohya`
  (models/families/*/lora_layout.py); a family without one (SD3: diffusers reads none back) writes none.

The check (`check_lora_file`): the file on disk is read by the family pipeline's `lora_state_dict`, where
diffusers converts a non-diffusers layout (load_lora_weights reads through it), its names brought to
peft's as diffusers' loader brings them. Every tensor of the adapter must come back under its own name,
equal, with the scale the reader applies (the metadata's alpha / r, the layout's alphas, or alpha / r
folded into the weights as kohya's converters fold it) giving ours; a tensor the reader adds (a fused
module's part we do not train) must be zero. A file that fails is not written: it is written under a
temporary name and renamed into place only once checked (common/atomic.py).
"""

from pathlib import Path

import torch

from common.atomic import atomic_path
from models.engine.family import LayoutUnavailable


class LayoutCheckError(ValueError):
    """A LoRA file read back by diffusers differs from the adapter (one line; the file is not written)."""


def kohya_file(name: str) -> str:
    """The kohya layout's file name in an export named `name` (the folder's name): the name ComfyUI
    lists it under once copied into its models/loras."""
    return f"{name}_kohya.safetensors"


def adapter(denoiser) -> tuple[dict[str, torch.Tensor], float, int]:
    """(the adapter's tensors under peft's names, alpha, rank) of a denoiser with one LoRA."""
    from peft.utils import get_peft_model_state_dict

    config = denoiser.peft_config["default"]
    if config.rank_pattern or config.alpha_pattern:
        raise LayoutUnavailable("an adapter with per-module ranks or alphas (rank_pattern, alpha_pattern)")
    return get_peft_model_state_dict(denoiser), float(config.lora_alpha), int(config.r)


def folded(scale: float) -> tuple[float, float]:
    """(lora_down's factor, lora_up's) of a reader that folds a scale into the weights: all into
    lora_down, balanced by powers of 2 below 1/2 (sd-scripts' convert_flux_lora.py, diffusers' kohya
    converters)."""
    down, up = scale, 1.0
    while down * 2 < up:
        down, up = down * 2, up / 2
    return down, up


def _read(pipeline_class, path: Path, prefix: str) -> tuple[dict, dict | None, dict | None]:
    """(tensors under peft's names, the kohya alphas, the metadata) of a LoRA file, as diffusers reads it."""
    from compat.diffusers import convert_unet_state_dict_to_peft

    reader = f"{pipeline_class.__name__}.lora_state_dict"
    try:
        read = pipeline_class.lora_state_dict(str(path), return_lora_metadata=True)
    except Exception as error:  # diffusers' converters raise ValueError, KeyError, AssertionError...
        why = str(error).strip().splitlines()[0] if str(error).strip() else ""
        raise LayoutCheckError(f"{reader} cannot read it ({type(error).__name__}: {why})") from error
    tensors, metadata = read[0], read[-1]
    alphas = read[1] if len(read) == 3 else None  # the UNet pipelines' network alphas
    foreign = sorted(k for k in tensors if not k.startswith(prefix + "."))
    if foreign or not tensors:
        raise LayoutCheckError(f"{reader} finds no {prefix} LoRA in it ({len(foreign)} other tensors)")
    tensors = {k[len(prefix) + 1 :]: v for k, v in tensors.items()}
    # diffusers' file: the adapter's config, under the component's name
    metadata = {k[len(prefix) + 1 :]: v for k, v in (metadata or {}).items() if k.startswith(prefix + ".")}
    if not any(".lora_A." in k for k in tensors):  # a UNet's older diffusers names, as its loader reads them
        tensors = convert_unet_state_dict_to_peft(tensors)
    return tensors, alphas, metadata


def _scale(alphas: dict | None, metadata: dict | None, rank: int, modules: int) -> float:
    """The scale (alpha / r) a pipeline's load_lora_weights gives the adapter it reads."""
    if metadata:  # diffusers' file: the adapter's config
        plain = not any(metadata.get(k) for k in ("rank_pattern", "alpha_pattern", "use_rslora", "use_dora"))
        if metadata.get("r") != rank or not plain:
            raise LayoutCheckError(
                f"its metadata's adapter (r={metadata.get('r')}) is not a rank {rank} LoRA"
            )
        return metadata["lora_alpha"] / rank
    if alphas:  # the kohya alphas of a UNet pipeline's converter
        if len(alphas) != modules or len(set(alphas.values())) != 1:
            raise LayoutCheckError(
                f"{len(alphas)} alphas of {sorted(set(alphas.values()))} for {modules} modules"
            )
        return next(iter(alphas.values())) / rank
    return 1.0  # no alphas: the loader sets alpha = r (what kohya's converters fold the scale for)


def check_lora_file(path: Path, pipeline_class, prefix: str, state: dict, alpha: float, rank: int) -> None:
    """LayoutCheckError (one line) unless `pipeline_class` reads the LoRA of `state` (peft's names),
    `alpha` and `rank` back from `path`: see the module's docstring."""
    read, alphas, metadata = _read(pipeline_class, path, prefix)
    modules = sum(".lora_A." in name for name in state)
    scale = _scale(alphas, metadata, rank, modules)
    down, up = folded(alpha / rank / scale)
    missing = sorted(state.keys() - read.keys())
    if missing:
        raise LayoutCheckError(
            f"{len(missing)} of the adapter's {len(state)} tensors are missing, e.g. {missing[0]}"
        )
    for name, ours in state.items():
        expected = ours * (down if ".lora_A." in name else up)
        if read[name].shape != ours.shape or not torch.equal(read[name], expected):
            raise LayoutCheckError(
                f"{name} differs from the adapter's x {down if '.lora_A.' in name else up:g} (read at "
                f"alpha / r = {scale:g}, the adapter's {alpha / rank:g})"
            )
    added = sorted(k for k in read.keys() - state.keys() if read[k].any())
    if added:
        raise LayoutCheckError(f"it holds {len(added)} nonzero tensors the adapter has not, e.g. {added[0]}")


def save_kohya(denoiser, folder: str | Path, family, name: str) -> tuple[Path | None, str | None]:
    """Write the kohya layout of `denoiser`'s adapter into `folder` as kohya_file(name), checked:
    (its path, None), or (None, why the family has no such file for this model). A file that fails
    its check raises LayoutCheckError and is not written."""
    from safetensors.torch import save_file

    if family.lora_kohya is None:
        return None, (
            f"the {family.name} family has no kohya layout that diffusers reads back "
            f"({family.pipeline.__name__}.lora_state_dict converts none)"
        )
    try:
        state, alpha, rank = adapter(denoiser)
        tensors = family.lora_kohya(state, alpha, denoiser)
    except LayoutUnavailable as why:
        return None, str(why)
    path = Path(folder) / kohya_file(name)
    with atomic_path(path) as tmp:
        save_file({k: t.detach().contiguous().clone() for k, t in tensors.items()}, tmp)
        try:
            check_lora_file(tmp, family.pipeline, family.denoiser, state, alpha, rank)
        except LayoutCheckError as error:
            raise LayoutCheckError(f"{path.name} (kohya layout) was not written: {error}") from None
    return path, None


def start_from(denoiser, path: str | Path, family) -> None:
    """Set `denoiser`'s adapter (as `model.lora` just added it) to the LoRA file at `path` (diffusers'
    file, a folder holding it, or a kohya file), read as the family pipeline's load_lora_weights reads
    it, with the scale it applies folded into lora_A so that the adapter's own alpha / r gives the same
    update. A file of another family, rank or set of modules is one ValueError line."""
    from peft.utils import set_peft_model_state_dict

    from models.checkpoints.checkpoint_file import LORA_FILE

    file = Path(path) / LORA_FILE if Path(path).is_dir() else Path(path)
    named = f"model.lora.init_from={path}"
    state, alpha, rank = adapter(denoiser)
    try:
        read, alphas, metadata = _read(family.pipeline, file, family.denoiser)
    except LayoutCheckError as error:
        raise ValueError(f"{named}: not a LoRA of the {family.name} family: {error}") from None
    ranks = sorted({v.shape[0] for k, v in read.items() if ".lora_A." in k})
    if ranks != [rank]:
        raise ValueError(f"{named}: a rank {'/'.join(map(str, ranks))} LoRA; model.lora.rank is {rank}")
    missing, other = sorted(state.keys() - read.keys()), sorted(read.keys() - state.keys())
    if missing or other:
        example = f"e.g. {(missing or other)[0]}"
        raise ValueError(
            f"{named}: its modules are not the adapter's (model.lora.target_modules): {len(missing)} of the "
            f"adapter's {len(state)} tensors missing, {len(other)} others ({example})"
        )
    shaped = sorted(k for k in state if read[k].shape != state[k].shape)
    if shaped:
        raise ValueError(
            f"{named}: {shaped[0]} is {tuple(read[shaped[0]].shape)}, the adapter's "
            f"{tuple(state[shaped[0]].shape)}: a LoRA of another model of the {family.name} family"
        )
    try:
        factor = _scale(alphas, metadata, rank, sum(".lora_A." in k for k in state)) / (alpha / rank)
    except LayoutCheckError as error:
        raise ValueError(f"{named}: {error}") from None
    weights = {k: v * factor if ".lora_A." in k else v for k, v in read.items()}
    set_peft_model_state_dict(denoiser, weights, adapter_name="default")
