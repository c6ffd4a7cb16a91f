"""What an mmdit model's export folder says (models/engine/flow_folder.py writes it): the README.md
model card, whose front matter holds the max_sequence_length to call StableDiffusion3Pipeline with
(models.generate reads it back), and the log's how-to."""

from models.engine.flow_folder import shift_origin
from models.families.mmdit.model import RectifiedFlowTransformer


def usage(model: RectifiedFlowTransformer) -> str:
    """How to load and call the folder, for the export's log line."""
    folder = "folder" if model.text_encoder_3 is not None else "folder, text_encoder_3=None, tokenizer_3=None"
    return (
        f"load it with StableDiffusion3Pipeline.from_pretrained({folder}) and call it with "
        f"max_sequence_length={model.t5_tokens} (the model's t5_tokens; the default 256 samples other images)"
    )


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
