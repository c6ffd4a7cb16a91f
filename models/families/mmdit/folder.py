"""An mmdit model's export folder (models/export.py, whose docstring says what the folder holds): a
diffusers StableDiffusion3Pipeline saved with the training run's flow-matching sampler, and a
README.md, the model card, whose front matter holds the max_sequence_length to call the pipeline
with (models.generate reads it back)."""

import logging
from pathlib import Path

from diffusers import StableDiffusion3Pipeline

from models.engine.family import README
from models.families.mmdit.model import RectifiedFlowTransformer

log = logging.getLogger(__name__)


def save_sd3_folder(model: RectifiedFlowTransformer, out_dir: Path, shown_as: Path | None = None) -> None:
    """A StableDiffusion3Pipeline folder of an mmdit model, and its README.md. `shown_as`: the name
    the log gives the folder (models.export writes under a temporary name, then renames)."""
    shown_as = shown_as or out_dir
    # The pipeline decodes latents / scaling_factor + shift_factor: the model's unscale_latents.
    model.vae.register_to_config(shift_factor=float(model.latent_shift))
    # The training run's flow-matching sampler with the shift it trained with at the model's native
    # size: generate()'s Euler steps at that size.
    scheduler = model.sampling_scheduler(model.native_size())
    pipeline = StableDiffusion3Pipeline(
        transformer=model.transformer,
        scheduler=scheduler,
        vae=model.vae,
        text_encoder=model.text_encoder,
        tokenizer=model.tokenizer,
        text_encoder_2=model.text_encoder_2,
        tokenizer_2=model.tokenizer_2,
        text_encoder_3=model.text_encoder_3,  # None (null in model_index.json) without T5
        tokenizer_3=model.tokenizer_3,
    )
    # diffusers warns that a None T5 "cannot be saved": it is meant to be absent.
    saver_log = logging.getLogger("diffusers.pipelines.pipeline_utils")
    absent_t5 = _DropMessages("text_encoder_3=None", "tokenizer_3=None")
    saver_log.addFilter(absent_t5)
    try:
        pipeline.save_pretrained(out_dir, safe_serialization=True)
    finally:
        saver_log.removeFilter(absent_t5)
    (out_dir / README).write_text(model_card(model))
    log.info(
        "wrote a StableDiffusion3Pipeline to %s: load it with StableDiffusion3Pipeline.from_pretrained(%s) "
        "and call it with max_sequence_length=%d (the model's t5_tokens; the default 256 samples other "
        "images); its scheduler's shift is %g, %s; as %s says",
        shown_as,
        "folder" if model.text_encoder_3 is not None else "folder, text_encoder_3=None, tokenizer_3=None",
        model.t5_tokens,
        scheduler.config.shift,
        shift_origin(model),
        shown_as / README,
    )


def shift_origin(model: RectifiedFlowTransformer) -> str:
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


def model_card(model: RectifiedFlowTransformer) -> str:
    """README.md of an mmdit export: how to load and sample it; its front matter holds the
    max_sequence_length (models.generate reads it)."""
    n = model.t5_tokens
    if model.text_encoder_3 is not None:
        t5 = f"T5 (text_encoder_3) reads each prompt as {n} tokens."
        arguments = ""
    else:
        t5 = (
            f"this model has no T5, and the T5 part of its context is {n} tokens of zeros, which the "
            "transformer still attends to. Without T5, diffusers loads the folder only when told to leave "
            "it off (text_encoder_3=None, tokenizer_3=None)."
        )
        arguments = ", text_encoder_3=None, tokenizer_3=None"
    shift = model.shift_for(model.native_size())
    other_sizes = ""
    if model.timestep_shift == "auto":
        other_sizes = (
            " To sample at another size with the shift the model trained with there: `pipe.scheduler = "
            "FlowMatchEulerDiscreteScheduler.from_config(pipe.scheduler.config, shift=(height * width) ** "
            "0.5 / 256)`."
        )
    return f"""---
library_name: diffusers
pipeline_tag: text-to-image
tags: [stable-diffusion-3, sd-recipes]
max_sequence_length: {n}
---
# {model.preset or "mmdit"}: a rectified-flow MMDiT exported by models.export

Call the pipeline with `max_sequence_length={n}`: {t5} The pipeline's default (256) gives other
images.

The scheduler's shift is {shift:g}: {shift_origin(model)}.{other_sizes}

```python
import torch
from diffusers import StableDiffusion3Pipeline

pipe = StableDiffusion3Pipeline.from_pretrained("path/to/this/folder"{arguments})
image = pipe("a red circle", max_sequence_length={n}, generator=torch.Generator().manual_seed(0)).images[0]
```

`python -m models.generate FOLDER "a red circle" --out grid.png` samples the same images (it reads the
number from this file).
"""
