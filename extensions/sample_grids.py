"""Sample grids while training: pictures of a fixed set of prompts every `interval` and at fit end.

    callbacks:
      samples:
        _target_: extensions.sample_grids.SampleGrids
        prompts: ["a photo of a cat", ...]
        interval: 5000ba

Each grid is `<folder>/ba<N>.png` (a row per (guidance, prompt), `per_prompt` columns, the same
seeds in every grid so that grids of one run compare picture by picture) with `ba<N>.json` beside it
(prompts, seeds, guidance scales, steps, sampler, resolution, batch, whether EMA weights drew it), and goes to
every logger through `logger.log_images` (wandb, MLflow). `folder` defaults to `samples/` under the
checkpoint folder, else `runs/<run_name>/samples`. `sampler` defaults to the model family's: ddim
for SD and SDXL, euler (flow-matching Euler steps, the only one) for an mmdit model. `resolution`
(pixels, square) defaults to the model's native size; a stage that trains below it sets its training
resolution (yamls/sd3-medium.yaml: 256, where `timestep_shift: auto` samples with the shift it trains
with).

Sampling uses the EMA weights when the run has EMA, and leaves training exactly as it was: the
weights are swapped back, the denoiser's train/eval mode restored and every RNG (python, numpy, torch,
CUDA) put back, so a run with this callback ends bitwise identical to one without. Every rank takes
part (FSDP needs all ranks in each forward pass; all draw the same images); rank 0 writes.
"""

import json
import logging
from contextlib import nullcontext
from pathlib import Path

import torch
from composer.core import Callback, Event, State
from composer.loggers import Logger
from composer.utils import create_interval_scheduler, dist, format_name_with_dist
from torchvision.utils import save_image

from extensions.callbacks import preserved_rng
from extensions.ema import find_ema
from models.cli_checks import check_guidance, check_size
from models.engine.objectives import SAMPLERS
from models.generate import sample_grid, sampler_for

log = logging.getLogger(__name__)


class SampleGrids(Callback):
    def __init__(
        self,
        prompts: list[str],
        interval: str = "5000ba",
        per_prompt: int = 4,
        seed: int = 0,
        guidance: list[float] | float = (5.0,),
        steps: int = 25,
        sampler: str | None = None,
        folder: str | None = None,
        resolution: int | None = None,
    ):
        # Checked here, where the config check builds it (recipes/config.py), not at the first grid.
        if not prompts:
            raise ValueError("SampleGrids needs at least one prompt")
        if sampler is not None and sampler not in SAMPLERS:
            raise ValueError(f"sampler={sampler!r} is not one of {sorted(SAMPLERS)}")
        checked = [("per_prompt", per_prompt), ("steps", steps)]
        checked += [] if resolution is None else [("resolution", resolution)]
        for name, value in checked:
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be a positive integer")
        self.resolution = resolution
        self.prompts, self.per_prompt, self.seed = list(prompts), per_prompt, seed
        scales = [guidance] if isinstance(guidance, int | float) else guidance
        for scale in scales:
            if isinstance(scale, bool) or not isinstance(scale, int | float):
                raise ValueError(f"guidance={scale!r} must be a number (a list of them for several rows)")
            check_guidance("guidance", float(scale))  # a ValueError whose message starts guidance=
        self.guidance = [float(g) for g in scales]
        self.steps, self.sampler, self.folder = steps, sampler, folder
        self._due = create_interval_scheduler(
            interval, include_end_of_training=True, checkpoint_events=False, final_events={Event.FIT_END}
        )

    def fit_start(self, state: State, logger: Logger) -> None:
        if not hasattr(_unwrapped(state), "generate"):
            name = type(_unwrapped(state)).__name__
            raise TypeError(f"SampleGrids needs a model that generates; {name} does not")
        self.folder = Path(self.folder or _default_folder(state))
        # None: the family's own (ddim for a UNet, euler for an mmdit model); one it has not is an error.
        self.sampler = sampler_for(_unwrapped(state), self.sampler)
        check_size("resolution", self.resolution, _unwrapped(state))  # sampling would round it down

    def batch_end(self, state: State, logger: Logger) -> None:
        if self._due(state, Event.BATCH_END):
            self.draw(state, logger)

    def fit_end(self, state: State, logger: Logger) -> None:
        if self._due(state, Event.FIT_END):
            self.draw(state, logger)

    def draw(self, state: State, logger: Logger) -> Path:
        batch = int(state.timestamp.batch)
        model = _unwrapped(state)
        ema = find_ema(state.algorithms)
        with preserved_rng(), torch.no_grad(), ema.averaged_weights() if ema else nullcontext():
            images = torch.cat(
                [
                    sample_grid(
                        model,
                        self.prompts,
                        self.per_prompt,
                        seed=self.seed,
                        guidance_scale=g,
                        num_inference_steps=self.steps,
                        sampler=self.sampler,
                        height=self.resolution,  # None: the model's native size
                        width=self.resolution,
                    )
                    for g in self.guidance
                ]
            )
        png = self.folder / f"ba{batch}.png"
        if dist.get_global_rank() == 0:
            self.folder.mkdir(parents=True, exist_ok=True)
            save_image(images, png, nrow=self.per_prompt, padding=2)
            rows = [{"guidance": g, "prompt": p} for g in self.guidance for p in self.prompts]
            record = {
                "batch": batch,
                "rows": rows,
                "per_prompt": self.per_prompt,
                "seed": self.seed,
                "steps": self.steps,
                "sampler": self.sampler,
                "resolution": int(images.shape[-1]),
                "ema": ema is not None,
            }
            png.with_suffix(".json").write_text(json.dumps(record, indent=1))
            log.info("samples at batch %d: %s", batch, png)
        for g, block in zip(self.guidance, images.chunk(len(self.guidance)), strict=True):  # guidance-major
            logger.log_images(block, name=f"samples/guidance_{g:g}", step=batch)
        return png


def _unwrapped(state: State):
    return getattr(state.model, "module", state.model)  # DDP wraps the model; FSDP wraps inside it


def _default_folder(state: State) -> Path:
    saver = next((cb for cb in state.callbacks if type(cb).__name__ == "CheckpointSaver"), None)
    if saver is not None and "://" not in str(saver.folder):
        return Path(format_name_with_dist(saver.folder, state.run_name)) / "samples"
    return Path("runs") / state.run_name / "samples"
