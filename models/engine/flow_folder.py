"""The export folder of a rectified-flow family (models/export.py calls the family's `save_folder`):
the family's diffusers pipeline built from the model's parts, with the training run's flow-matching
sampler at the model's native size (generate()'s Euler steps there), and a README.md, the model card
the family writes, whose front matter holds the call arguments that make the pipeline sample what
`generate` samples (models.generate reads them back).

A family folder gives its pipeline class, its component names, its `model_card(model)` and its
`usage(model)` (the log's "load it with ... and call it with ..."): `flow_folder_writer(...)`.
"""

import functools
import logging
from pathlib import Path

from models.engine.family import README

log = logging.getLogger(__name__)


def flow_folder_writer(pipeline: type, components, model_card, usage):
    """A family's `save_folder`: (model, out_dir, shown_as=None) -> None, writing `pipeline`."""
    return functools.partial(
        save_flow_folder, pipeline=pipeline, components=tuple(components), model_card=model_card, usage=usage
    )


def save_flow_folder(
    model, out_dir: Path, shown_as: Path | None = None, *, pipeline, components, model_card, usage
) -> None:
    """`pipeline`'s folder of a flow model (its `components`, the scheduler aside, read from the
    model; one the model goes without, such as SD3's optional T5, is saved as null), and its
    README.md. `shown_as`: the name the log gives the folder (models.export writes under a temporary
    name, then renames)."""
    shown_as = shown_as or out_dir
    # The pipeline decodes latents / scaling_factor + shift_factor: the model's unscale_latents. A VAE
    # with no scaling_factor (FLUX.2's: its batch-norm statistics, which the folder holds) takes neither.
    if "scaling_factor" in model.vae.config:
        model.vae.register_to_config(shift_factor=float(model.latent_shift))
    # The training run's sampler with the shift it trained with at the model's native size.
    scheduler = model.sampling_scheduler(model.native_size())
    parts = {name: getattr(model, name, None) for name in components if name != "scheduler"}
    folder = pipeline(scheduler=scheduler, **parts)
    # diffusers warns that a None part "cannot be saved": it is meant to be absent.
    saver_log = logging.getLogger("diffusers.pipelines.pipeline_utils")
    absent = _DropMessages(*(f"{name}=None" for name, part in parts.items() if part is None))
    saver_log.addFilter(absent)
    try:
        folder.save_pretrained(out_dir, safe_serialization=True)
    finally:
        saver_log.removeFilter(absent)
    (out_dir / README).write_text(model_card(model))
    log.info(
        "wrote a %s to %s: %s; its scheduler's shift is %g, %s; as %s says",
        pipeline.__name__,
        shown_as,
        usage(model),
        scheduler.config.shift,
        shift_origin(model),
        shown_as / README,
    )


def shift_origin(model) -> str:
    """Where an export's scheduler shift comes from, in words (the log's and the README's)."""
    if model.timestep_shift is None:
        return "the model's noise scheduler's, which it trained with (timestep_shift unset)"
    if model.timestep_shift == "auto":
        height, width = model.native_size()
        return (
            f"what it trained with at its native {height} x {width} px (timestep_shift: auto, "
            "sqrt(pixels / 256^2) at each size; the pipeline keeps this one at every size)"
        )
    return "the timestep_shift it trained with"


class _DropMessages(logging.Filter):
    def __init__(self, *fragments: str):
        super().__init__()
        self.fragments = fragments

    def filter(self, record: logging.LogRecord) -> bool:
        return not any(fragment in record.getMessage() for fragment in self.fragments)
