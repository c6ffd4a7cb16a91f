"""The demo's LoRA stage: a LoRA teaches the trained tiny model a shape it never saw, the cross.

After the diffusion stage (demo/run.py), on its checkpoint:
1. `models.export` writes the trained model (EMA weights) as a diffusers folder, the LoRA run's base;
2. yamls/tiny-lora-concept-cpu.yaml trains a peft adapter on the UNet's attention projections on
   shapes of which half are crosses in the four colours (the `shapes-cross` preparer,
   recipes/prepare.py; the base data never hold a cross: data/synthetic.py NEW_SHAPES), with the
   same frozen random text encoder, whose CLIP vocabulary already has "cross" as one token;
3. the adapted model (EMA adapter) samples the new prompts ("a red cross", ...) and the old ones, and
   the pixel classifier (demo/classifier.py, which has a cross template) judges them: LORA_GATES;
4. `models.export --lora` writes the adapter as diffusers' LoRA file, which diffusers'
   StableDiffusionPipeline.load_lora_weights reads onto the exported base and samples with the same
   noise: its images must equal our model's within SAME_IMAGES.
"""

import json
import logging
import shutil
import time
from pathlib import Path

import torch

from data.synthetic import COLORS, NEW_SHAPES
from demo.classifier import classify, score
from demo.judge import GUIDANCE, STEPS, evaluate
from extensions.ema import ema_weights
from recipes import load_config, train
from recipes.prepare import prepare_cross_mds

log = logging.getLogger(__name__)

RECIPE = Path(__file__).resolve().parents[1] / "yamls" / "tiny-lora-concept-cpu.yaml"
CONCEPT = NEW_SHAPES[0]
CONCEPT_PROMPTS = [f"a {color} {CONCEPT}" for color in COLORS]
# The stage passes when >= 90% of the new prompts' samples show a cross (shape) in the asked colour
# (colour), and the old prompts' colour and shape accuracy each stay within 5 points of the base
# model's on the same samples (seed 0), i.e. at most 3 of 72 images lost.
LORA_GATES = {"concept": 0.9, "old_drop": 0.05}
# diffusers' pipeline with the LoRA file against our model on the same noise: both run the same DDIM
# steps in float32, so they differ by rounding only (pixel values in [0, 1]; 1/255 is 4e-3).
SAME_IMAGES = 1e-4
# --quick: the quick base knows only three prompts; its LoRA stage teaches one cross prompt.
QUICK_LORA = {
    # On the quick base, 2026-11-29 (1 thread): 600 batches at lr 5e-3 drew 4 crosses of 4, the old
    # prompts' shape as before (83%), colour 100% -> 83%; 400 at 5e-3 drew 3 of 4 and the old shape fell
    # to 67%; 400 at 2e-3 failed the old prompts (50%); 150 at the recipe's lr drew no cross.
    "overrides": ["trainer.max_duration=600ba", "optimizer.lr=5.0e-3", "callbacks.samples.interval=600ba"],
    "prompts": ["a red cross"],
    "gates": {"concept": 0.75, "old_drop": 0.25},  # 4 images of the concept, 12 of the old prompts
}


def _group(rows: list[dict], prompts: list[str]) -> dict[str, float]:
    """Colour/shape accuracy of the manifest rows of `prompts`."""
    mine = [row for row in rows if row["prompt"] in prompts]
    return score([(row["color"], row["shape"]) for row in mine], [row["prompt"] for row in mine])


def export_base(checkpoint: Path, folder: Path) -> Path:
    """The diffusion stage's model (EMA weights) as a diffusers folder, written afresh: the LoRA run's
    frozen base must be the checkpoint the demo just judged."""
    from models.export import main as export

    shutil.rmtree(folder, ignore_errors=True)
    export([str(checkpoint), str(folder)])
    return folder


def diffusers_matches(base: Path, lora_dir: Path, checkpoint: Path, prompts: list[str], n: int) -> dict:
    """Max |difference| between diffusers' pipeline with our LoRA file and our model's own sampling
    (`generate`, the judge's settings) on the same noise, and the classifier's verdicts of both."""
    from diffusers import DDIMScheduler, StableDiffusionPipeline

    from models.checkpoints.checkpoint_file import LORA_FILE
    from models.export import load_model_from_checkpoint

    ours = load_model_from_checkpoint(checkpoint)  # the EMA adapter on the base folder's networks
    pipe = StableDiffusionPipeline.from_pretrained(base, local_files_only=True)
    pipe.scheduler = DDIMScheduler.from_config(pipe.scheduler.config)  # generate()'s sampler
    pipe.set_progress_bar_config(disable=True)
    # Offline (as the demo runs), load_lora_weights needs the file's name, diffusers' default.
    pipe.load_lora_weights(lora_dir, weight_name=LORA_FILE)
    channels, size = pipe.unet.config.in_channels, pipe.unet.config.sample_size
    worst, same = 0.0, 0
    for prompt in prompts:  # as demo/judge.py samples: a prompt's images at once, seed 0
        mine = ours.generate([prompt] * n, seed=0, guidance_scale=GUIDANCE, num_inference_steps=STEPS)
        noise = torch.randn((n, channels, size, size), generator=torch.Generator().manual_seed(0))
        theirs = pipe(
            [prompt] * n, latents=noise, guidance_scale=GUIDANCE, num_inference_steps=STEPS, output_type="pt"
        ).images
        worst = max(worst, float((mine.cpu() - theirs).abs().max()))
        same += sum(classify(a) == classify(b) for a, b in zip(mine, theirs, strict=True))
    return {"max_abs_diff": worst, "same_verdicts": same / (n * len(prompts)), "images": n * len(prompts)}


def lora_stage(
    checkpoint: Path,
    out: Path,
    base_result: dict,
    old_prompts: list[str],
    per_prompt: int,
    quick: bool,
    encode,
) -> dict:
    """Run the stage on the diffusion stage's `checkpoint`, whose judged samples of `old_prompts` are
    `base_result` (demo.judge.evaluate's, manifest included); returns the stage's summary. `encode`:
    demo.run's precompute_latents (the overrides that train on the recipe's data encoded once)."""
    settings = QUICK_LORA if quick else {"overrides": [], "prompts": CONCEPT_PROMPTS, "gates": LORA_GATES}
    concept, times = settings["prompts"], {}
    cfg = load_config(RECIPE, settings["overrides"])

    start = time.perf_counter()
    base = export_base(checkpoint, Path(cfg.model.pretrained))
    # Encoded once by the base's frozen VAE and text encoder, as the diffusion stage's data: a step
    # then costs the UNet alone (the demo machine's cores are often shared; it is ~3x faster).
    prepare_cross_mds(cfg.data.train.local)
    # --quick: only the images of its prompts, as its base overfits three prompts.
    cfg = load_config(
        RECIPE, settings["overrides"] + encode(cfg, concept + old_prompts if quick else None)[0]
    )
    # The base model on the new prompts, before the adapter: it has never seen a cross.
    from models.generate import load_model

    before = evaluate(load_model(base), out / "lora" / "base-samples", per_prompt, seed=0, prompts=concept)
    trainer = train(cfg)
    times["lora_train"] = time.perf_counter() - start

    start = time.perf_counter()
    with ema_weights(trainer):
        after = evaluate(
            trainer.state.model, out / "lora" / "samples", per_prompt, seed=0, prompts=concept + old_prompts
        )
    trainer.close()
    saved = trainer.saved_checkpoints or [Path(cfg.trainer.save_folder, "latest-rank0.pt").resolve()]
    lora_checkpoint = Path(saved[-1])
    times["lora_eval"] = time.perf_counter() - start

    start = time.perf_counter()
    from models.export import main as export

    lora_dir = out / "lora" / "export"
    shutil.rmtree(lora_dir, ignore_errors=True)
    export([str(lora_checkpoint), str(lora_dir), "--lora"])
    check = diffusers_matches(base, lora_dir, lora_checkpoint, concept, per_prompt)
    times["lora_export"] = time.perf_counter() - start

    rows = json.loads(after["manifest"].read_text())
    old_before = _group(json.loads(base_result["manifest"].read_text()), old_prompts)
    new, old_after = _group(rows, concept), _group(rows, old_prompts)
    gates = settings["gates"]
    passed = {
        "concept": min(new["shape"], new["color"]) >= gates["concept"],
        "old": all(old_after[k] >= old_before[k] - gates["old_drop"] for k in ("color", "shape")),
        "diffusers": check["max_abs_diff"] <= SAME_IMAGES,
    }
    return {
        "concept": CONCEPT,
        "prompts": concept,
        "base_on_concept": {k: before[k] for k in ("color", "shape", "both")},
        "concept_after": new,
        "old_before": old_before,
        "old_after": old_after,
        "diffusers": check,
        "gates": {**gates, "same_images": SAME_IMAGES, **{f"{k}_passed": v for k, v in passed.items()}},
        "passed": all(passed.values()),
        "checkpoint": str(lora_checkpoint),
        "lora_file": str(lora_dir),
        "grid": str(after["grid"]),
        "seconds": {k: round(v, 1) for k, v in times.items()},
    }


def lora_report(lora: dict) -> str:
    """The stage's lines of the demo's printout."""
    new, before, after = lora["concept_after"], lora["old_before"], lora["old_after"]
    return (
        f"LoRA stage: {new['shape']:.1%} of the new prompts' samples show a {lora['concept']} (colour "
        f"{new['color']:.1%}; the base model: {lora['base_on_concept']['shape']:.1%}); old prompts colour "
        f"{before['color']:.1%} -> {after['color']:.1%}, shape {before['shape']:.1%} -> "
        f"{after['shape']:.1%}; diffusers with the LoRA file: max |diff| "
        f"{lora['diffusers']['max_abs_diff']:.1e}\n"
        f"LoRA file:  {Path(lora['lora_file']).resolve()}\nLoRA grid:  {Path(lora['grid']).resolve()}"
    )
