"""Checks of the FLUX.2 draft presets (issue 50), by hand until the family is registered:

    python -m models.families.flux2.verify           # meta-device counts vs PUBLISHED, then the tiny checks
    python -m models.families.flux2.verify --tiny    # only the tiny checks (CPU, seconds)

- every full-size preset's transformer, VAE and text encoder, built on the meta device with the classes
  the diffusers pipelines load (Flux2Transformer2DModel, AutoencoderKLFlux2, Qwen3ForCausalLM /
  Mistral3ForConditionalGeneration), summed with numel and compared with PUBLISHED;
- `flux2-tiny` built for real: one transformer forward with Flux2KleinPipeline's input shapes (packed
  patchified latents, stacked hidden states, 4-axis ids, timestep / 1000), the latents' round trip
  (patchify, batch-norm, pack and back), and a 2-step Flux2KleinPipeline call on the tiny parts with the
  offline tokenizer.
"""

import argparse

import torch
from diffusers import (
    AutoencoderKLFlux2,
    FlowMatchEulerDiscreteScheduler,
    Flux2KleinPipeline,
    Flux2Transformer2DModel,
)
from transformers import Mistral3Config, Mistral3ForConditionalGeneration, Qwen3Config, Qwen3ForCausalLM

from models.families.flux2.presets import FLUX2, PUBLISHED


def text_encoder(config: dict):
    """The pipeline's text encoder class for a preset's config: Mistral 3 (dev) or Qwen3 (klein)."""
    if "text_config" in config:
        return Mistral3ForConditionalGeneration(Mistral3Config(**config))
    return Qwen3ForCausalLM(Qwen3Config(**config))


def parts(preset: str) -> dict:
    spec = FLUX2[preset]
    return dict(
        transformer=Flux2Transformer2DModel(**spec["transformer"]),
        vae=AutoencoderKLFlux2(**spec["vae"]),
        text_encoder=text_encoder(spec["text_encoder"]),
    )


def count(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())  # shared (tied) parameters once


def check_counts() -> None:
    for preset, published in PUBLISHED.items():
        with torch.device("meta"):
            built = parts(preset)
        measured = {name: count(part) for name, part in built.items()}
        measured["latent_scale"] = FLUX2[preset]["latent_scale"]
        status = "ok" if measured == published else "DIFFERS"
        print(f"{preset}: {status}")
        for name in ("transformer", "vae", "text_encoder"):
            print(f"  {name:13s} published {published[name]:>15,}  meta {measured[name]:>15,}")
        assert measured == published, (preset, measured, published)


def patchify(latents: torch.Tensor) -> torch.Tensor:
    return Flux2KleinPipeline._patchify_latents(latents)


def check_tiny() -> None:
    torch.manual_seed(0)
    spec = FLUX2["flux2-tiny"]
    tiny = parts("flux2-tiny")
    transformer, vae, encoder = tiny["transformer"].eval(), tiny["vae"].eval(), tiny["text_encoder"].eval()
    print("flux2-tiny:", {name: count(part) for name, part in tiny.items()})
    batch, tokens = 2, spec["text_tokens"]

    with torch.no_grad():
        # Latents as Flux2KleinPipeline._encode_vae_image makes them: argmax, 2x2 patches, batch-norm stats.
        images = torch.rand(batch, 3, 32, 32) * 2 - 1
        latents = vae.encode(images).latent_dist.mode()  # (B, 4, 8, 8)
        latents = patchify(latents)  # (B, 16, 4, 4)
        mean = vae.bn.running_mean.view(1, -1, 1, 1)
        std = torch.sqrt(vae.bn.running_var.view(1, -1, 1, 1) + vae.config.batch_norm_eps)
        normed = (latents - mean) / std
        ids = Flux2KleinPipeline._prepare_latent_ids(normed)  # (B, 16, 4): (t, h, w, l)
        packed = Flux2KleinPipeline._pack_latents(normed)  # (B, 16, 16)
        back = Flux2KleinPipeline._unpack_latents_with_ids(packed, ids, 4, 4)
        assert torch.equal(back, normed)
        assert torch.equal(
            Flux2KleinPipeline._unpatchify_latents(patchify(torch.arange(64.0).view(1, 4, 4, 4))),
            torch.arange(64.0).view(1, 4, 4, 4),
        )

        # The context as _get_qwen3_prompt_embeds stacks it: hidden_states[k] for k in the layers,
        # (B, 3, L, D) -> (B, L, 3 D), padded rows kept; text ids (0, 0, 0, l).
        input_ids = torch.randint(0, spec["text_encoder"]["vocab_size"], (batch, tokens))
        mask = torch.ones(batch, tokens, dtype=torch.long)
        mask[1, 10:] = 0  # a padded caption
        hidden = encoder(input_ids=input_ids, attention_mask=mask, output_hidden_states=True, use_cache=False)
        stacked = torch.stack([hidden.hidden_states[k] for k in spec["text_encoder_layers"]], dim=1)
        context = stacked.permute(0, 2, 1, 3).reshape(batch, tokens, -1)
        text_ids = Flux2KleinPipeline._prepare_text_ids(context)
        assert context.shape == (batch, tokens, spec["transformer"]["joint_attention_dim"])
        assert text_ids.shape == (batch, tokens, 4) and ids.shape == (batch, 16, 4)

        sigma = torch.tensor([0.7, 0.3])
        noise = torch.randn_like(normed)
        noisy = Flux2KleinPipeline._pack_latents(
            (1 - sigma.view(-1, 1, 1, 1)) * normed + sigma.view(-1, 1, 1, 1) * noise
        )
        out = transformer(
            hidden_states=noisy,
            timestep=sigma * 1000 / 1000,  # the pipeline's `timestep / 1000`: sigma itself
            guidance=None,
            encoder_hidden_states=context,
            txt_ids=text_ids,
            img_ids=ids,
            return_dict=False,
        )[0]
        assert out.shape == packed.shape and torch.isfinite(out).all()
        print("  transformer forward:", tuple(noisy.shape), "->", tuple(out.shape))

    # The whole Flux2KleinPipeline on the tiny parts, with the offline tokenizer.
    from models.engine.llm_conditioner import build_llm_tokenizer

    pipe = Flux2KleinPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler.from_config(spec["published_scheduler"]),
        vae=vae,
        text_encoder=encoder,
        tokenizer=build_llm_tokenizer(),
        transformer=transformer,
        is_distilled=False,
    )
    pipe.set_progress_bar_config(disable=True)
    images = pipe(
        prompt=["a red circle", "a blue square"],  # the first positional argument is `image`
        height=32,
        width=32,
        num_inference_steps=2,
        guidance_scale=4.0,
        max_sequence_length=tokens,
        text_encoder_out_layers=spec["text_encoder_layers"],
        generator=torch.Generator().manual_seed(0),
        output_type="pt",
    ).images
    assert images.shape == (2, 3, 32, 32) and torch.isfinite(images).all()
    print("  Flux2KleinPipeline (2 steps, CFG 4):", tuple(images.shape))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="only the tiny checks")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if not args.tiny:
        check_counts()
    check_tiny()
