"""`make demo`: synthetic shapes -> image folder -> MDS -> tiny VAE -> tiny SD -> judged samples.

`--preset mmdit-tiny` trains the tiny rectified-flow transformer (SD3's structure,
yamls/tiny-mmdit-cpu.yaml) instead of the tiny UNet in step 3, `--preset flux-tiny` the tiny Flux.1
transformer (yamls/tiny-flux-cpu.yaml), on the same VAE's latents, judged by the same classifier
against the same gates.

1. yamls/tiny-vae.yaml makes the data on first use (data/synthetic.py, converted with
   `sd-convert folder` by recipes/prepare.py) and trains the autoencoder, then writes it in
   diffusers format.
2. Gate: the VAE's reconstructions of unseen shapes must keep their colour (and shape) by the same
   classifier that judges the samples; a diffusion model cannot draw colours its VAE cannot decode.
3. `convert latents` encodes the shapes once with the frozen VAE and text encoder (about 20% of a
   training step's time otherwise), and yamls/tiny-cpu.yaml trains the UNet on those latents, with
   EMA and caption dropout (yamls/tiny-mmdit-cpu.yaml the transformer, with --preset mmdit-tiny).
4. demo/judge.py samples every prompt from the EMA weights with classifier-free guidance
   and measures how often colour and shape match the prompt; below GATES the demo fails.
5. `evaluation.evaluate --extractors tiny` samples one image per caption of held-out shapes (another
   seed) at several guidance scales and reports FID, KID and CLIP score against those shapes (with
   random stand-in networks: the numbers rank runs of this demo, they are not published-FID scale).
6. With the tiny UNet (the default preset), demo/lora_stage.py teaches the trained model a shape it
   never saw, the cross, with a LoRA (yamls/tiny-lora-concept-cpu.yaml), judges the new and the old
   prompts against LORA_GATES, and checks that diffusers' pipeline with the exported LoRA file draws
   the same images.

Runs offline on a CPU; everything lands under runs/. `python -m demo --quick` is a short
version for the tests.
"""

import argparse
import json
import logging
import os
import random
import shutil
import time
from pathlib import Path

import numpy as np
import torch
from composer.utils import reproducibility

from common.atomic import atomic_path
from convert.folder import iter_samples as folder_samples
from convert.latents import iter_samples, preset_columns
from convert.mds import write_mds
from data.synthetic import COLORS, SHAPES, draw_shape, write_shapes_folder
from demo.judge import PROMPTS, evaluate, judge
from demo.lora_stage import lora_report, lora_stage
from evaluation import evaluate as image_metrics
from extensions.ema import ema_weights
from models import build
from models.registry import FAMILIES
from recipes import load_config, parse_config, train

YAMLS = Path(__file__).resolve().parents[1] / "yamls"
OUT = Path("runs/demo")  # like the recipes' own paths, relative to where the demo runs
# One process owns the machine here, unlike the tests (which `make` limits to one thread each): all
# cores for torch and one dataloader worker decoding images beside it. Measured on 2 cores, tiny
# UNet, batch 64: 2.6 batches/s with 1 thread and no worker, 3.9 with 2 threads and 1 worker.
DATA_WORKERS = ["data.train.num_workers=1"]
VAE_GATE = 0.9  # reconstruction colour accuracy needed before the diffusion stage
# --quick: the test's shortened run. The whole path runs, but the diffusion stage overfits three
# prompts that differ in both colour and shape (their ~500 images of the 2,048) instead of learning
# all twelve, which takes ~1,000 batches.
QUICK = {
    "vae": ["trainer.max_duration=150ba"],  # 100 batches: colour 71%, below the gate
    "diffusion": {
        # 450 batches of 64: colour 100%, shape 75-83% (12 images; 1 or 2 threads); 250 batches still
        # ignored the prompt, and 450 of 32 reached only 75% / 67%.
        "tiny": [
            "trainer.max_duration=450ba",
            "optimizer.lr=4.0e-3",
            "scheduler.t_warmup=25ba",
            "algorithms.ema.half_life=25ba",
        ],
        # 700 batches: colour 100%, shape 92% (12 images; 89% over 36); the transformer needs more
        # than the UNet: 450 batches drew blobs (shape 50%, also at lr 2e-3 or timestep_shift 3),
        # 550 at lr 6e-3 reached 75%.
        "mmdit-tiny": [
            "trainer.max_duration=700ba",
            "optimizer.lr=4.0e-3",
            "scheduler.t_warmup=25ba",
            "algorithms.ema.half_life=25ba",
        ],
        # mmdit-tiny's settings, measured for flux-tiny: colour 100%, shape 100% (12 images, 1 thread,
        # 2026-11-27; diffusion stage 130 s).
        "flux-tiny": [
            "trainer.max_duration=700ba",
            "optimizer.lr=4.0e-3",
            "scheduler.t_warmup=25ba",
            "algorithms.ema.half_life=25ba",
        ],
        # 1000 batches for zimage-tiny: colour 100%, shape 83.3% (12 images, 1 thread, 2026-11-29; diffusion
        # stage 436 s on a loaded machine); at flux-tiny's 700, colour 50%, shape 75%: below the gate.
        "zimage-tiny": [
            "trainer.max_duration=1000ba",
            "optimizer.lr=4.0e-3",
            "scheduler.t_warmup=25ba",
            "algorithms.ema.half_life=25ba",
        ],
        # 1000 batches for flux2-tiny as for zimage-tiny: at 700, colour 100%, shape 66.7% (12 images, 1
        # thread, 2026-11-29; diffusion stage 185 s), too near the gate.
        "flux2-tiny": [
            "trainer.max_duration=1000ba",
            "optimizer.lr=4.0e-3",
            "scheduler.t_warmup=25ba",
            "algorithms.ema.half_life=25ba",
        ],
    },
    "per_prompt": 4,
    "prompts": ["a red circle", "a green square", "a blue triangle"],
    "metrics": ["--num-captions", "24", "--guidance", "1", "4", "--steps", "10"],
    "gates": {"color": 0.75, "shape": 0.6},  # 12 images of 3 prompts: well above chance (1/3)
}
# The diffusion stage's recipe per --preset: each registered family's tiny recipe (models/registry.py),
# for the families whose --quick settings the demo has measured (QUICK's diffusion), all on the same
# VAE, judged the same way.
RECIPES = {f.tiny: f"{f.tiny_recipe}.yaml" for f in FAMILIES.values() if f.tiny in QUICK["diffusion"]}
# Colour and shape accuracy the samples of every prompt must reach for the demo to pass (the UNet
# demo's run of 2026-11-23: 100% and 95.8%; chance is 25% and 33%).
GATES = {"color": 0.9, "shape": 0.9}
# Step 5: 192 held-out captions, 3 guidance scales, 25 steps of the family's sampler (DDIM, or Euler
# for the transformer; as demo/judge.py): ~1 minute.
METRICS = ["--num-captions", "192", "--guidance", "1", "4", "8", "--steps", "25"]
HELDOUT_SEED, HELDOUT_SIZE = 1, 512


def vae_reconstruction_accuracy(autoencoder, n: int = 240, seed: int = 1) -> dict[str, float]:
    """Colour/shape accuracy of the VAE's reconstructions of `n` fresh shapes (another seed than the
    training data's)."""
    rng = random.Random(seed)
    images, prompts = [], []
    for _ in range(n):
        color, shape = rng.choice(list(COLORS)), rng.choice(SHAPES)
        pixels = np.array(draw_shape(color, shape, 32, rng, noisy_background=rng.random() < 0.3))
        images.append(torch.from_numpy(pixels).permute(2, 0, 1).float() / 127.5 - 1)
        prompts.append(f"a {color} {shape}")
    autoencoder.eval()
    reconstructions = (autoencoder.reconstruct(torch.stack(images)) + 1) / 2
    return judge(reconstructions, prompts)[1]


def precompute_latents(cfg, prompts: list[str] | None = None) -> tuple[list[str], torch.nn.Module]:
    """Encode the recipe's training set (only the samples captioned with one of `prompts`, if given)
    once with its frozen VAE and text encoder (`convert latents`); returns the overrides that train on
    the result, and the encoding model.

    The tiny recipe's text encoder is random: built here after the same seed as in the training run,
    it is the same one (main() checks that after training)."""
    run = parse_config(cfg)
    reproducibility.seed_all(run.seed)
    model = build(**run.model).eval()
    data, preset = run.data.train, run.model["preset"]
    name = f"{data.local}-latents-{preset}-{data.resolution}"  # each preset has its own encoders
    out = Path(name + ("-" + "-".join(sorted(prompts)) if prompts else ""))
    out = out.with_name(out.name.replace(" ", "_"))
    if not (out / "index.json").exists():
        samples = iter_samples(data.local, model, [data.resolution], 256, preset=preset)
        with atomic_path(out) as tmp:
            write_mds(
                (row for row in samples if prompts is None or row["caption"] in prompts),
                str(tmp),
                preset_columns(preset, [data.resolution]),
            )
    return ["data.train.latents=true", f"data.train.local={out}", "data.train.prepare=null"], model


def heldout_shapes(out: Path, prompts: list[str] | None) -> Path:
    """An MDS set of shapes the models never saw (another seed than the training set's), only those
    captioned with one of `prompts` when given."""
    mds = out / "heldout" / "mds"
    if not (mds / "index.json").exists():
        images = write_shapes_folder(out / "heldout" / "images", HELDOUT_SIZE, seed=HELDOUT_SEED)
        rows = (row for row in folder_samples(images) if prompts is None or row["caption"] in prompts)
        with atomic_path(mds) as tmp:
            write_mds(rows, str(tmp))
    return mds


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(
        prog="python -m demo", description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="a short run (the test's)")
    parser.add_argument(
        "--preset", choices=sorted(RECIPES), default="tiny",
        help="the diffusion model: tiny (UNet, DDPM), or a rectified-flow transformer: mmdit-tiny, "
        "flux-tiny, zimage-tiny, flux2-tiny",
    )  # fmt: skip
    parser.add_argument("--out", default=str(OUT), help="where the samples and the summary go")
    parser.add_argument("--per-prompt", type=int, default=6, help="samples per prompt (12 prompts)")
    parser.add_argument(
        "--threads", type=int, default=len(os.sched_getaffinity(0)), help="torch threads (default: all cores)"
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    out = Path(args.out)
    full = {"vae": [], "diffusion": [], "per_prompt": args.per_prompt, "prompts": None, "metrics": METRICS}
    quick = dict(QUICK, diffusion=QUICK["diffusion"][args.preset]) if args.quick else dict(full, gates=GATES)
    recipe = YAMLS / RECIPES[args.preset]
    times = {}

    begin = start = time.perf_counter()
    vae_trainer = train(load_config(YAMLS / "tiny-vae.yaml", DATA_WORKERS + quick["vae"]))
    recon = vae_reconstruction_accuracy(vae_trainer.state.model)
    vae_trainer.close()  # ends its progress bar and loggers before the next stage starts
    times["vae"] = time.perf_counter() - start
    print(f"VAE reconstructions: colour {recon['color']:.1%}, shape {recon['shape']:.1%} (240 unseen images)")
    if recon["color"] < VAE_GATE:
        raise SystemExit(
            f"the VAE reconstructs only {recon['color']:.1%} of colours (< {VAE_GATE:.0%}); train it "
            "longer (yamls/tiny-vae.yaml trainer.max_duration) before the diffusion stage"
        )

    start = time.perf_counter()
    latents, encoder = precompute_latents(load_config(recipe, quick["diffusion"]), quick["prompts"])
    sd_cfg = load_config(recipe, DATA_WORKERS + quick["diffusion"] + latents)
    sd_trainer = train(sd_cfg)
    times["diffusion"] = time.perf_counter() - start
    trained = sd_trainer.state.model.state_dict()
    text_encoders = {k: v for k, v in encoder.state_dict().items() if k.startswith("text_encoder")}
    if any(not torch.equal(v, trained[k]) for k, v in text_encoders.items()):
        raise RuntimeError("the latents were encoded with other text encoders than the ones trained with")

    start = time.perf_counter()
    with ema_weights(sd_trainer):
        prompts = {"prompts": quick["prompts"]} if quick["prompts"] else {}
        result = evaluate(sd_trainer.state.model, out / "samples", quick["per_prompt"], seed=0, **prompts)
    times["eval"] = time.perf_counter() - start
    sd_trainer.close()
    # A rerun of the demo continues its runs (autoresume); one that had finished saves nothing new.
    saved = sd_trainer.saved_checkpoints or [Path(sd_cfg.trainer.save_folder, "latest-rank0.pt").resolve()]
    checkpoint = Path(saved[-1])

    start = time.perf_counter()
    # A fresh model: the previous demo's images (same checkpoint path) must not be reused.
    shutil.rmtree(out / "metrics" / "images", ignore_errors=True)
    print("FID / KID / CLIP score on held-out shapes (tiny random extractors: compare demo runs only)")
    metrics = image_metrics.main(
        [str(checkpoint), "--data", str(heldout_shapes(out, quick["prompts"])), "--out", str(out / "metrics")]
        + ["--extractors", "tiny", "--seed", "0", *quick["metrics"]]
    )
    times["metrics"] = time.perf_counter() - start

    lora = None
    if args.preset == "tiny":  # the LoRA recipe adapts the tiny UNet (yamls/tiny-lora-concept-cpu.yaml)
        start = time.perf_counter()
        old = quick["prompts"] or PROMPTS
        lora = lora_stage(checkpoint, out, result, old, quick["per_prompt"], args.quick, precompute_latents)
        times["lora"] = time.perf_counter() - start
    times["total"] = time.perf_counter() - begin

    passed = all(result[k] >= gate for k, gate in quick["gates"].items())
    summary = {
        "preset": args.preset,
        "vae_reconstruction": recon,
        "samples": {k: result[k] for k in ("color", "shape", "both", "images")},
        "gates": {**quick["gates"], "passed": passed},
        "metrics": metrics,
        "lora": lora,
        "seconds": {k: round(v, 1) for k, v in times.items()},
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(f"checkpoint: {checkpoint.resolve()}")
    rows = f"a row per prompt, {result['images'] // result['per_prompt']} prompts"
    print(f"samples:    {result['grid'].resolve()}  ({rows})")
    print(f"manifest:   {result['manifest'].resolve()}")
    progress = sorted(checkpoint.parent.glob("samples/ba*.png"), key=lambda p: int(p.stem[2:]))
    print(f"training:   {len(progress)} sample grids under {checkpoint.parent.resolve() / 'samples'}")
    print(
        f"colour accuracy {result['color']:.1%}, shape accuracy {result['shape']:.1%} over "
        f"{result['images']} images (seed 0); stages took "
        + ", ".join(f"{k} {v:.0f}s" for k, v in times.items() if k != "total")
        + f" ({times['total']:.0f}s in all)"
    )
    if lora is not None:
        print(lora_report(lora))
    gates = ", ".join(f"{k} >= {v:.0%}" for k, v in quick["gates"].items())
    if not passed:
        raise SystemExit(f"FAILED the gates ({gates}): the {args.preset} model did not learn the prompts")
    if lora is not None and not lora["passed"]:
        raise SystemExit(f"FAILED the LoRA stage's gates: {lora['gates']}")
    print(f"passed the gates ({gates})" + (", and the LoRA stage's" if lora is not None else ""))
    return summary


if __name__ == "__main__":
    main()
