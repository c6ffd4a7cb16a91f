"""Records tests/golden/family-bits.json: the exact bits every model family gives today, so that a
refactor of models/ (issue 38: objectives, conditioners, one ComposerModel, a family table) can prove
it changed none of them. tests/test_families.py recomputes them and compares.

For each tiny preset, trained by its tiny CPU recipe from one seed for a few batches on the tests'
64-image shapes set (tests/conftest.py tiny_run):
  - the training losses (exact floats),
  - the sha256 of every tensor of the pipeline `python -m models.export` writes from the final
    checkpoint (and of its JSON configs, path-like keys left out),
  - the sha256 of the images `generate` samples from that checkpoint with a fixed seed,
  - the sha256 of every array column of the first rows of `sd-convert latents --preset P`.

Run it only to re-record, when numerics change on purpose (a library upgrade, a fix that changes
losses), and commit the JSON with that change, saying why in the commit message:

    OMP_NUM_THREADS=1 .venv/bin/python -m tests.golden.make_family_bits

It writes the commit it ran at; a re-record from a tree with uncommitted changes to models/, data/,
convert/ or recipes/ is marked "dirty" so a reader knows the bits may not be that commit's.
`--add PRESET` records one family that has none yet, leaving the others' bits as recorded (its
commit goes under "added"):

    OMP_NUM_THREADS=1 .venv/bin/python -m tests.golden.make_family_bits --add flux-tiny

Another CPU gives other last bits for the same code (its kernels sum in another order: on 2026-11-29
an AVX-512 AMD EPYC moved the tiny families' losses by ~1e-7 relative from the recording machine's).
So each machine kind's bits are kept under "machines", keyed by `numerics_fingerprint()` (the bits of
a few kernels the models use, on fixed inputs); `--machine` records this machine's, from a commit
whose bits equal the recorded ones on a recorded machine (a refactor's check holds on every machine):

    OMP_NUM_THREADS=1 .venv/bin/python -m tests.golden.make_family_bits --machine
"""

import hashlib
import json
import logging
import subprocess
import sys
import tempfile
from pathlib import Path

from models.registry import FAMILIES

REPO = Path(__file__).resolve().parents[2]
GOLDEN = Path(__file__).with_name("family-bits.json")
# Every registered family's tiny preset -> its CPU recipe (the family's declaration: models/registry.py).
RECIPES = {family.tiny: family.tiny_recipe for family in FAMILIES.values()}
BATCHES = 3
PROMPTS = ["a red circle", "a blue square"]
SAMPLING = dict(guidance_scale=4.0, num_inference_steps=4, seed=3)
LATENT_ROWS = 4  # of the 64 shapes: a few samples per preset
CODE = ["models", "data", "convert", "recipes", "extensions"]


def tensor_sha(tensor) -> str:
    """sha256 of a tensor's dtype, shape and raw bytes (any dtype, bf16 included)."""
    import torch

    t = tensor.detach().cpu().contiguous()
    digest = hashlib.sha256(f"{t.dtype} {tuple(t.shape)}".encode())
    digest.update(t.reshape(-1).view(dtype=torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def array_sha(array) -> str:
    import numpy as np

    a = np.ascontiguousarray(array)
    return hashlib.sha256(f"{a.dtype} {a.shape}".encode() + a.tobytes()).hexdigest()


def _config(path: Path) -> dict:
    """A JSON config without keys that name where it was written (a temporary folder)."""
    config = json.loads(path.read_text())
    return {k: v for k, v in config.items() if k not in ("_name_or_path", "name_or_path")}


def pipeline_bits(folder: Path) -> dict[str, str]:
    """'component/file:tensor' -> sha256 for every tensor file, 'component/file' -> sha256 of each JSON
    config, of an exported pipeline folder."""
    from safetensors.torch import load_file

    bits = {}
    for path in sorted(folder.rglob("*")):
        name = str(path.relative_to(folder))
        if path.suffix == ".safetensors":
            bits.update({f"{name}:{k}": tensor_sha(v) for k, v in sorted(load_file(path).items())})
        elif path.suffix == ".json":
            text = json.dumps(_config(path), sort_keys=True)
            bits[name] = hashlib.sha256(text.encode()).hexdigest()
        elif path.suffix in (".bin", ".pt", ".ckpt"):
            raise AssertionError(f"{name}: a weights file that is not safetensors; hash it too")
    return bits


def train(preset: str, shapes_mds: Path, out: Path) -> tuple[list[float], Path]:
    """The preset's tiny recipe for BATCHES batches from the recipe's seed: (losses, checkpoint)."""
    from extensions.callbacks import read_loss_log
    from recipes import build_trainer, load_config
    from tests.conftest import tiny_run

    log = out / "loss.jsonl"
    overrides = [
        *tiny_run(shapes_mds, BATCHES),
        f"trainer.save_folder={out}",
        "trainer.save_filename=ckpt.pt",
        "algorithms.ema.half_life=2",  # so that the exported average differs from the raw weights
        f"+callbacks.loss_log={{_target_: extensions.callbacks.LossLog, path: {log}}}",
    ]
    trainer = build_trainer(load_config(REPO / f"yamls/{RECIPES[preset]}.yaml", overrides))
    trainer.fit()
    trainer.close()
    losses = read_loss_log(log)
    assert list(losses) == list(range(1, BATCHES + 1)), losses
    return list(losses.values()), out / "ckpt.pt"


def latents_bits(preset: str, shapes_mds: Path, out: Path) -> list[dict[str, str]]:
    """`sd-convert latents --preset P` of the shapes at 32 px: per row of the first LATENT_ROWS,
    column -> sha256 (array columns) or the value (key, caption)."""
    import numpy as np

    from tests.convert_fixtures import read_mds, run_cli

    argv = ["latents", "--src", shapes_mds / "mds", "--out", out, "--preset", preset]
    assert run_cli(*argv, "--resolutions", 32, "--batch-size", 32) == 0
    rows = read_mds(out)[:LATENT_ROWS]
    return [
        {k: array_sha(v) if isinstance(v, np.ndarray) else v for k, v in sorted(row.items())} for row in rows
    ]


def family_bits(preset: str, shapes_mds: Path, work: Path) -> dict:
    """Everything recorded for one preset, computed in `work` (an empty folder)."""
    from models import export
    from models.export import load_model_from_checkpoint

    losses, checkpoint = train(preset, shapes_mds, work / "run")
    export.main([str(checkpoint), str(work / "pipeline")])
    model = load_model_from_checkpoint(checkpoint)
    images = model.generate(PROMPTS, **SAMPLING)
    return {
        "losses": losses,
        "image": tensor_sha(images),
        "latents": latents_bits(preset, shapes_mds, work / "latents"),
        "pipeline": pipeline_bits(work / "pipeline"),
    }


def build_shapes(root: Path) -> Path:
    """The shapes set of tests/conftest.py shapes_mds, built the same way."""
    from convert.folder import iter_samples
    from convert.mds import write_mds
    from data.synthetic import write_shapes_folder

    write_shapes_folder(root / "images", n=64, size=32, seed=0)
    write_mds(iter_samples(root / "images"), str(root / "mds"))
    return root


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, check=True).stdout.strip()


def record(presets) -> dict:
    import torch

    torch.set_num_threads(1)  # as tests/conftest.py: other thread counts give other last bits
    logging.basicConfig(level=logging.WARNING)
    with tempfile.TemporaryDirectory() as tmp:
        shapes = build_shapes(Path(tmp) / "shapes")
        families = {}
        for preset in presets:
            (Path(tmp) / preset).mkdir()
            families[preset] = family_bits(preset, shapes, Path(tmp) / preset)
    return families


def numerics_fingerprint() -> str:
    """16 hex digits of the bits a few of the models' CPU kernels give on fixed inputs, one thread: a
    convolution, matmuls in fp32 and bf16, group norm, attention, SiLU and exp. Two machines with the
    same fingerprint have given the same family bits; different ones (another SIMD width or vendor
    library path) give other last bits."""
    import torch
    import torch.nn.functional as F

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        g = torch.Generator().manual_seed(0)
        x = torch.randn(2, 32, 16, 16, generator=g)
        w = torch.randn(64, 32, 3, 3, generator=g)
        q, k, v = torch.randn(3, 2, 4, 64, 16, generator=g)
        a, b = torch.randn(96, 200, generator=g), torch.randn(200, 72, generator=g)
        outs = [
            F.conv2d(x, w, padding=1),
            a @ b,
            (a.bfloat16() @ b.bfloat16()).float(),
            F.group_norm(x, 8),
            F.scaled_dot_product_attention(q, k, v),
            F.silu(a).exp(),
        ]
    finally:
        torch.set_num_threads(threads)
    digest = hashlib.sha256()
    for out in outs:
        digest.update(tensor_sha(out).encode())
    return digest.hexdigest()[:16]


def cpu_name() -> str:
    """The CPU's model name, for a reader of the JSON."""
    import platform

    for line in Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []:
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def recorded_sets(golden: dict) -> dict[str, dict]:
    """Each machine's recorded families by fingerprint: the first recording's (fingerprint
    "recording machine", not taken then) and those of `--machine`."""
    sets = {golden.get("fingerprint", "recording machine"): golden["families"]}
    sets.update({fp: rec["families"] for fp, rec in golden.get("machines", {}).items()})
    return sets


def add_machine(out: Path = GOLDEN) -> None:
    """Record every family's bits for this machine's kind into `out`, the others left as recorded."""
    import torch

    golden, fingerprint = json.loads(out.read_text()), numerics_fingerprint()
    if fingerprint in recorded_sets(golden):
        raise SystemExit(f"this machine's kind ({fingerprint}) is recorded already")
    dirty = bool(_git("status", "--porcelain", "--untracked-files=no", "--", *CODE))
    golden.setdefault("machines", {})[fingerprint] = {
        "cpu": cpu_name(),
        "commit": _git("rev-parse", "HEAD"),
        "dirty": dirty,
        "torch": torch.__version__,
        "families": record(RECIPES),
    }
    out.write_text(json.dumps(golden, indent=1, sort_keys=True) + "\n")
    print(f"added this machine ({cpu_name()}, fingerprint {fingerprint}) to {out}")


def add(preset: str, out: Path = GOLDEN) -> None:
    """Record `preset` alone into `out`, whose other families stay as recorded."""
    golden = json.loads(out.read_text())
    machine = golden.get("machines", {}).get(numerics_fingerprint())  # this machine's kind's set, if any
    families = golden["families"] if machine is None else machine["families"]
    if preset in families:
        raise SystemExit(f"{preset} is recorded already: re-record them all when numerics change on purpose")
    dirty = bool(_git("status", "--porcelain", "--untracked-files=no", "--", *CODE))
    families[preset] = record([preset])[preset]
    golden.setdefault("added", {})[preset] = {"commit": _git("rev-parse", "HEAD"), "dirty": dirty}
    out.write_text(json.dumps(golden, indent=1, sort_keys=True) + "\n")
    print(f"added {preset} to {out}")


def main(out: Path = GOLDEN) -> None:
    import torch

    dirty = bool(_git("status", "--porcelain", "--untracked-files=no", "--", *CODE))
    families = record(RECIPES)
    golden = {
        "generator": "tests/golden/make_family_bits.py",
        "commit": _git("rev-parse", "HEAD"),
        "dirty": dirty or bool(_git("status", "--porcelain", "--untracked-files=no", "--", *CODE)),
        "torch": torch.__version__,
        "threads": 1,
        "families": families,
    }
    out.write_text(json.dumps(golden, indent=1, sort_keys=True) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--add"]:
        add(sys.argv[2])
    elif sys.argv[1:2] == ["--machine"]:
        add_machine()
    else:
        main(Path(sys.argv[1]) if len(sys.argv) > 1 else GOLDEN)
