"""What a flux model's export folder says (models/engine/flow_folder.py writes it): the README.md model
card, whose front matter holds the FluxPipeline call arguments that make the pipeline sample what
`generate` samples (models.generate reads max_sequence_length back; tests/test_families.py passes the
rest), and the log's how-to."""

from models.engine.flow_folder import shift_origin
from models.families.flux.model import Flux


def usage(model: Flux) -> str:
    """How to call the folder, for the export's log line."""
    return "call it with " + ", ".join(f"{k}={v!r}" for k, v in call_arguments(model).items())


def call_arguments(model: Flux) -> dict:
    """FluxPipeline's call arguments that sample what `model.generate` samples (besides the prompts,
    steps and generator): T5's length, the native size (the pipeline's default is 1024 px whatever the
    VAE), and without the guidance embedding the empty negative prompt that turns on its classifier-free
    guidance (`true_cfg_scale`, which `generate`'s guidance_scale is)."""
    height, width = model.native_size()
    arguments = {"max_sequence_length": model.t5_tokens, "height": height, "width": width}
    if not model.transformer.config.guidance_embeds:
        arguments["negative_prompt"] = ""
    return arguments


def guidance_argument(model: Flux) -> str:
    """The FluxPipeline argument `generate`'s guidance_scale is: the embedded guidance of a
    guidance-distilled transformer, else true classifier-free guidance."""
    return "guidance_scale" if model.transformer.config.guidance_embeds else "true_cfg_scale"


def model_card(model: Flux) -> str:
    """README.md of a flux export: how to load and sample it. Its front matter holds the call arguments
    (`call_arguments`) and, as `guidance_scale_argument`, the pipeline argument that takes generate's
    guidance scale."""
    arguments = call_arguments(model)
    front = "\n".join(
        f"{key}: {value!r}" if isinstance(value, str) else f"{key}: {value}"
        for key, value in arguments.items()
    )
    call = ", ".join(f"{key}={value!r}" for key, value in arguments.items())
    scale = guidance_argument(model)
    if scale == "true_cfg_scale":
        guidance = (
            "This transformer has no guidance embedding: classifier-free guidance runs a second branch on "
            'the negative prompt, which FluxPipeline does only when given one (`negative_prompt=""` is the '
            "empty caption caption dropout trained) and `true_cfg_scale` > 1; its `guidance_scale` does "
            "nothing here."
        )
    else:
        guidance = "This transformer embeds the guidance scale (`guidance_scale`), with no second branch."
    return f"""---
library_name: diffusers
pipeline_tag: text-to-image
tags: [flux, sd-recipes]
{front}
guidance_scale_argument: {scale}
---
# {getattr(model, "preset", None) or "flux"}: a Flux.1 rectified-flow transformer exported by models.export

{guidance} T5 reads each prompt as {model.t5_tokens} tokens (`max_sequence_length`).

The scheduler's shift is {model.objective.shift_for(model.native_size()):g}: {shift_origin(model)}.

```python
import torch
from diffusers import FluxPipeline

pipe = FluxPipeline.from_pretrained("path/to/this/folder")
image = pipe("a red circle", {call}, {scale}=5.0, generator=torch.Generator().manual_seed(0)).images[0]
```

`python -m models.generate FOLDER "a red circle" --guidance 5 --out grid.png` samples the same images.
"""
