"""What is Flux's own (models/families/flux/model.py, issue 40); the checks every family passes are in
tests/test_families.py (flux-tiny is in its conformance suite)."""

import json

import pytest
import torch
from diffusers import FluxPipeline, FluxTransformer2DModel

from models import build_model
from models.build import bundled_tokenizers
from models.cli_checks import size_multiple_of
from models.components import build_components
from models.engine.objectives import FlowOptions, RectifiedFlow
from models.families.flux.model import TRAIN_GUIDANCE, Flux, image_ids, pack, unpack
from models.presets import size_multiple
from tests.conftest import REPO, tiny_run

PROMPTS = ["a red circle", "a blue square"]


def test_packing_and_position_ids_are_flux_pipeline_s():
    latents = torch.randn(2, 16, 8, 12)
    packed = pack(latents)
    assert torch.equal(packed, FluxPipeline._pack_latents(latents, 2, 16, 8, 12))
    # The pipeline unpacks from pixel sizes (latents x the VAE's factor, 8 here).
    assert torch.equal(unpack(packed, 8, 12), FluxPipeline._unpack_latents(packed, 64, 96, 8))
    assert torch.equal(unpack(packed, 8, 12), latents)
    expected = FluxPipeline._prepare_latent_image_ids(2, 4, 6, "cpu", torch.float32)
    assert torch.equal(image_ids(8, 12), expected) and expected[7].tolist() == [0.0, 1.0, 1.0]


def test_the_transformer_gets_t_in_0_1_and_the_pipeline_s_inputs():
    """A training step hands the transformer the objective's noise level t (not 1000 t: FluxPipeline
    divides by 1000, the transformer multiplies again), the packed latents, zero text ids, T5's context
    of t5_tokens tokens and CLIP's pooled vector. (flops_per_batch from ids and from stored embeddings
    alike: tests/test_families.py.)"""
    model = build_model("flux-tiny").train()
    batch = {"image": torch.rand(2, 3, 32, 32) * 2 - 1, **model.conditioner.ids(model, PROMPTS)}
    seen = {}
    hook = model.transformer.register_forward_pre_hook(lambda m, a, k: seen.update(k), with_kwargs=True)
    torch.manual_seed(0)
    _, _, level = model(batch)
    hook.remove()
    assert torch.equal(seen["timestep"], level) and ((level > 0) & (level < 1)).all()
    assert seen["hidden_states"].shape == (2, 16, 16)  # 8 x 8 latents of 4 channels -> 16 tokens of 16
    assert seen["encoder_hidden_states"].shape == (2, 8, 64) and seen["pooled_projections"].shape == (2, 32)
    assert not seen["txt_ids"].any() and seen["img_ids"].shape == (16, 3) and seen["guidance"] is None
    # Image sides: multiples of the VAE's 4 x the 2x2 packing, for the CLIs, the buckets and generate.
    assert size_multiple_of(model)[0] == size_multiple("flux-tiny") == 8
    with pytest.raises(ValueError, match="multiples of 8"):
        model.generate(PROMPTS, height=36, num_inference_steps=1)


@pytest.mark.heavy
def test_uniform_timesteps_are_the_presets_default_and_an_option():
    """The flux presets train on uniform timesteps (the MLPerf reference's torch.rand), made from the
    same normal draws as logit-normal ones (their CDF); other presets keep logit-normal; a UNet preset
    refuses the option and uniform refuses the logit-normal's shape options."""
    assert build_model("flux-tiny").timestep_density == "uniform"
    assert build_model("flux-tiny", timestep_density="logit_normal").timestep_density == "logit_normal"
    assert build_model("mmdit-tiny").timestep_density == "logit_normal"
    scheduler = build_model("flux-tiny").noise_scheduler
    t = RectifiedFlow(scheduler, FlowOptions(timestep_density="uniform")).sample_timesteps(
        torch.randn(200_000, generator=torch.Generator().manual_seed(0)), (32, 32)
    )
    counts = torch.histc(t, bins=10, min=0, max=1) / len(t)
    assert torch.allclose(counts, torch.full((10,), 0.1), atol=0.005)  # logit-normal: 0.02 .. 0.15
    logit = RectifiedFlow(scheduler).sample_timesteps(torch.tensor([0.0, 1.0]), (32, 32))
    assert torch.allclose(logit, torch.sigmoid(torch.tensor([0.0, 1.0])))
    with pytest.raises(ValueError, match="timestep_density is a rectified-flow option"):
        build_model("tiny", timestep_density="uniform")
    with pytest.raises(ValueError, match="uniform takes neither"):
        build_model("flux-tiny", timestep_mean=0.5)
    with pytest.raises(ValueError, match="model.timestep_density='cosine'"):
        build_model("flux-tiny", timestep_density="cosine")


def test_a_full_preset_s_t5_tokenizer_comes_from_a_folder():
    with pytest.raises(ValueError, match=r"tokenizer \(tokenizer_2\) is not built offline"):
        build_model("flux-schnell")


@pytest.mark.heavy
def test_flux_flops_are_the_analytic_count():
    """flux-schnell at MLPerf's 256 px (32 x 32 latents -> 256 image tokens, 256 T5 tokens): each of the
    57 blocks' token-wise matmuls are 12 D^2 per token (double-stream blocks: each stream's on its own
    tokens; single-stream: on all), attention 4 L^2 D, the embedders and projection; forward + backward
    = 3 x forward. About 20.4 TFLOP per image."""
    from models.flops import training_flops_per_image

    d, image, text, blocks = 3072, 256, 256, 19 + 38
    tokens = image + text
    forward = (
        2 * (12 * d * d * tokens * blocks + 64 * d * image * 2 + 4096 * d * text) + 4 * tokens**2 * d * blocks
    )
    counted = training_flops_per_image("flux-schnell", 256)
    assert counted == pytest.approx(3 * forward, rel=0.01)
    assert 20e12 < counted < 21e12


def _dev_like_tiny() -> Flux:
    """flux-tiny with FLUX.1-dev's guidance embedding."""
    torch.manual_seed(0)
    parts = build_components("flux-tiny")
    config = {k: v for k, v in parts["transformer"].config.items() if not k.startswith("_")}
    parts["transformer"] = FluxTransformer2DModel(**{**config, "guidance_embeds": True})
    model = Flux(**parts, **bundled_tokenizers("flux-tiny"), t5_tokens=8, timestep_density="uniform")
    model.preset = None
    return model.eval()


@pytest.mark.heavy
def test_a_guidance_embedding_trains_at_a_fixed_scale_and_exports_as_flux_dev_samples(tmp_path):
    """With FLUX.1-dev's guidance embedding, training passes TRAIN_GUIDANCE; generate's guidance scale
    is the embedded one, with no second branch, as FluxPipeline's `guidance_scale`: the export's README
    says so and the pipeline samples generate's image; the folder loads back as a flux model."""
    from models.export import export_pipeline
    from models.generate import load_model_from_pipeline_dir

    model = _dev_like_tiny()
    batch = {"image": torch.rand(2, 3, 32, 32) * 2 - 1, **model.conditioner.ids(model, PROMPTS)}
    seen = {}
    hook = model.transformer.register_forward_pre_hook(lambda m, a, k: seen.update(k), with_kwargs=True)
    model(batch)
    hook.remove()
    assert torch.equal(seen["guidance"], torch.full((2,), TRAIN_GUIDANCE))
    expected = model.generate(PROMPTS, guidance_scale=3.0, num_inference_steps=3, seed=1)
    assert not torch.equal(
        expected, model.generate(PROMPTS, guidance_scale=6.0, num_inference_steps=3, seed=1)
    )
    folder = export_pipeline(model, tmp_path / "out")
    assert "guidance_scale_argument: guidance_scale" in (folder / "README.md").read_text()
    assert json.loads((folder / "model_index.json").read_text())["_class_name"] == "FluxPipeline"
    pipe = FluxPipeline.from_pretrained(folder, local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    images = pipe(
        PROMPTS, guidance_scale=3.0, num_inference_steps=3, max_sequence_length=8, height=32, width=32,
        generator=torch.Generator().manual_seed(1), output_type="pt",
    ).images  # fmt: skip
    torch.testing.assert_close(images, expected, atol=1e-6, rtol=0)
    loaded = load_model_from_pipeline_dir(folder)  # SD3's networks have the same names: not an mmdit
    assert type(loaded) is Flux and loaded.t5_tokens == 8 and loaded.transformer.config.guidance_embeds


@pytest.mark.fit
def test_the_tiny_recipe_trains_on_images_and_on_precomputed_encodings_with_the_same_loss(
    shapes_mds, tmp_path
):
    """yamls/tiny-flux-cpu.yaml for 2 batches from the shapes' images and token ids, and from what
    `sd-convert latents --recipe` stored for them (the recipe's own random encoders): the same losses to
    fp16 storage's precision, in the same order (no shuffle, no flips: stored latents are unflipped)."""
    from composer import Callback

    from recipes import build_trainer, load_config
    from tests.convert_fixtures import run_cli

    recipe = REPO / "yamls/tiny-flux-cpu.yaml"
    out = tmp_path / "latents"
    argv = ["latents", "--src", shapes_mds / "mds", "--out", out, "--resolutions", 32, "--precision", "fp32"]
    assert run_cli(*argv, "--recipe", recipe, "model.pretrained=null") == 0
    columns = json.loads((out / "index.json").read_text())["shards"][0]["column_names"]
    assert {"text_embeds", "pooled_text_embeds"} <= set(columns) and "text_embeds_3" not in columns
    same = [*tiny_run(shapes_mds, 2), "data.train.shuffle=false", "data.train.hflip=false"]
    runs = {"images": same, "latents": [*same, f"data.train.local={out}", "data.train.latents=true"]}
    losses = {}
    for name, overrides in runs.items():
        trainer = build_trainer(load_config(recipe, overrides))
        losses[name] = []

        class Losses(Callback):
            def after_loss(self, state, logger, seen=losses[name]):
                seen.append(float(state.loss))

        trainer.state.callbacks.append(Losses())
        trainer.fit()
        trainer.close()
    assert len(losses["images"]) == 2 and all(torch.isfinite(torch.tensor(losses["images"])))
    torch.testing.assert_close(
        torch.tensor(losses["latents"]), torch.tensor(losses["images"]), rtol=5e-3, atol=1e-4
    )
