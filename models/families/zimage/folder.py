"""What a zimage model's export folder says (models/engine/flow_folder.py writes it): the README.md model
card, whose front matter holds the ZImagePipeline call arguments that make it sample what `generate`
samples (models.generate reads max_sequence_length back), and the log's how-to."""

from models.engine.flow_folder import shift_origin
from models.families.zimage.model import ZImage


def call_arguments(model: ZImage) -> dict:
    """ZImagePipeline's call arguments besides prompts, steps, guidance and generator: the chat prompt's
    length and the native size (the pipeline's default is 1024 px whatever the VAE)."""
    height, width = model.native_size()
    return {"max_sequence_length": model.text_tokens, "height": height, "width": width}


def usage(model: ZImage) -> str:
    """How to call the folder, for the export's log line."""
    return "call it with " + ", ".join(f"{k}={v!r}" for k, v in call_arguments(model).items())


def model_card(model: ZImage) -> str:
    """README.md of a zimage export: how to load and sample it; the call arguments in its front matter."""
    arguments = call_arguments(model)
    front = "\n".join(f"{key}: {value}" for key, value in arguments.items())
    call = ", ".join(f"{key}={value!r}" for key, value in arguments.items())
    return f"""---
library_name: diffusers
pipeline_tag: text-to-image
tags: [z-image, sd-recipes]
{front}
---
# {getattr(model, "preset", None) or "zimage"}: a Z-Image rectified-flow transformer exported by models.export

The text encoder reads each prompt as a chat message of at most {model.text_tokens} tokens
(`max_sequence_length`). `guidance_scale` is ZImagePipeline's: cond + g (cond - uncond), 0 for none.

The scheduler's shift is {model.objective.shift_for(model.native_size()):g}: {shift_origin(model)}.

```python
import torch
from diffusers import ZImagePipeline

pipe = ZImagePipeline.from_pretrained("path/to/this/folder")
image = pipe("a red circle", {call}, guidance_scale=4.0, generator=torch.Generator().manual_seed(0)).images[0]
```

`python -m models.generate FOLDER "a red circle" --guidance 4 --out grid.png` samples the same images.
"""
