"""What a flux2 model's export folder says (models/engine/flow_folder.py writes it): the README.md model
card, whose front matter holds the Flux2KleinPipeline call arguments that make it sample what `generate`
samples (models.generate reads max_sequence_length back), and the log's how-to."""

from models.families.flux2.model import Flux2, quarter_layers


def call_arguments(model: Flux2) -> dict:
    """Flux2KleinPipeline's call arguments besides prompts, steps, guidance and generator: the chat
    prompt's length, the stacked layers (the pipeline's default is Qwen3-4B/8B's (9, 18, 27)) and the
    native size."""
    height, width = model.native_size()
    layers = quarter_layers(model.text_encoder.config.get_text_config().num_hidden_layers)
    return {
        "max_sequence_length": model.text_tokens,
        "text_encoder_out_layers": list(layers),
        "height": height,
        "width": width,
    }


def usage(model: Flux2) -> str:
    """How to call the folder, for the export's log line."""
    return "call it with " + ", ".join(f"{k}={v!r}" for k, v in call_arguments(model).items())


def model_card(model: Flux2) -> str:
    """README.md of a flux2 export: how to load and sample it; the call arguments in its front matter."""
    arguments = call_arguments(model)
    front = "\n".join(f"{key}: {value}" for key, value in arguments.items())
    call = ", ".join(f"{key}={value!r}" for key, value in arguments.items())
    return f"""---
library_name: diffusers
pipeline_tag: text-to-image
tags: [flux2, sd-recipes]
{front}
---
# {getattr(model, "preset", None) or "flux2"}: a FLUX.2 rectified-flow transformer exported by models.export

The text encoder reads each prompt as a chat message of at most {model.text_tokens} tokens
(`max_sequence_length`), its layers {list(arguments["text_encoder_out_layers"])} side by side.
`guidance_scale` above 1 is classifier-free guidance against the empty prompt:
uncond + g (cond - uncond). The scheduler shifts its sigmas by the pipeline's empirical `mu` for each
resolution and step count (compute_empirical_mu), whatever shift training used.

```python
import torch
from diffusers import Flux2KleinPipeline

pipe = Flux2KleinPipeline.from_pretrained("path/to/this/folder")
image = pipe("a red circle", {call}, guidance_scale=4.0, generator=torch.Generator().manual_seed(0)).images[0]
```

`python -m models.generate FOLDER "a red circle" --guidance 4 --out grid.png` samples the same images.
"""
