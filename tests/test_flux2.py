"""FLUX.2 klein's own steps against Flux2KleinPipeline's (diffusers 0.42.1), on flux2-tiny with batch-norm
statistics that are not the identity: the latents' normalisation and packing (`_encode_vae_image`,
`_pack_latents`), the transformer's call in training (ids, timestep / 1000), the stacked layers per
encoder depth, and a folder's dynamic-shifting scheduler read back as the unshifted one training uses.
The rest (the exported folder samples generate's image bit for bit, counts of the published checkpoints
on the meta device, the checkpoint record) is the conformance suite's (tests/test_families.py)."""

import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler, Flux2KleinPipeline

from models import build_model
from models.families.flux2.model import pack, patchify, quarter_layers
from models.families.flux2.presets import FLUX2, PUBLISHED_SCHEDULER, TRAIN_SCHEDULER
from models.registry import PRESETS


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    model = build_model("flux2-tiny").eval()
    model.vae.bn.running_mean.normal_()
    model.vae.bn.running_var.uniform_(0.5, 2.0)
    return model


def test_every_preset_stacks_the_layers_its_pipeline_stacks():
    for preset, spec in FLUX2.items():
        config = spec["text_encoder"].get("text_config", spec["text_encoder"])
        assert quarter_layers(config["num_hidden_layers"]) == spec["text_encoder_layers"], preset
        assert PRESETS[preset] is spec


def test_latents_are_normalised_and_packed_as_the_pipeline_s(model):
    images = torch.rand(2, 3, 32, 32) * 2 - 1
    with torch.no_grad():
        mode = model.vae.encode(images).latent_dist.mode()
        ours = pack(patchify(model.scale_latents(mode)))
        pipe = Flux2KleinPipeline(
            scheduler=None, vae=model.vae, text_encoder=None, tokenizer=None, transformer=model.transformer
        )
        theirs = Flux2KleinPipeline._pack_latents(pipe._encode_vae_image(images, generator=None))
    assert torch.equal(ours, theirs)
    torch.testing.assert_close(model.unscale_latents(model.scale_latents(mode)), mode)


def test_the_training_call_is_the_pipeline_s_transformer_call(model):
    torch.manual_seed(1)
    noisy, context = torch.randn(2, 4, 8, 8), torch.randn(2, model.text_tokens, 96)
    timesteps = torch.tensor([700.0, 300.0])
    with torch.no_grad():
        ours = model.denoise(noisy, timesteps, {"encoder_hidden_states": context})
        patches = Flux2KleinPipeline._patchify_latents(noisy)
        theirs = model.transformer(
            hidden_states=Flux2KleinPipeline._pack_latents(patches),
            timestep=timesteps / 1000,
            guidance=None,
            encoder_hidden_states=context,
            txt_ids=Flux2KleinPipeline._prepare_text_ids(context),
            img_ids=Flux2KleinPipeline._prepare_latent_ids(patches),
            return_dict=False,
        )[0]
    assert torch.equal(pack(patchify(ours)), theirs)


def test_a_folder_s_dynamic_scheduler_trains_unshifted(model):
    published = FlowMatchEulerDiscreteScheduler.from_config(PUBLISHED_SCHEDULER)
    parts = {name: getattr(model, name) for name in ("transformer", "vae", "text_encoder", "tokenizer")}
    loaded = type(model)(**parts, noise_scheduler=published, latent_scale=1.0, text_tokens=model.text_tokens)
    config = loaded.noise_scheduler.config
    assert not config.use_dynamic_shifting and config.shift == TRAIN_SCHEDULER["shift"]
    assert model.sampling_scheduler().config.use_dynamic_shifting
