"""SDXL's model (models/families/sdxl/model.py): the conditioning against diffusers' own SDXL pipeline,
micro-conditioning, and the tiny recipe training. (Sizes, caption dropout, precomputed embeddings: the
suite of every family, tests/test_families.py.)"""

import pytest
import torch
from diffusers import EulerDiscreteScheduler, StableDiffusionXLPipeline

from models import build_model
from models.engine.tokenizer import tokenize
from models.registry import PRESETS
from recipes import build_trainer, load_config
from tests.conftest import REPO, tiny_run


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return build_model("sdxl-tiny").eval()


def _batch(model, captions, size=32, **extra):
    return {
        "image": torch.rand(len(captions), 3, size, size) * 2 - 1,
        "input_ids": tokenize(model.tokenizer, captions),
        "input_ids_2": tokenize(model.tokenizer_2, captions),
        **extra,
    }


def test_text_conditioning_is_what_the_diffusers_sdxl_pipeline_computes(model):
    """The context (both encoders' penultimate states side by side) and the pooled vector equal
    StableDiffusionXLPipeline.encode_prompt's for the same encoders; its unconditional half is
    zeros (force_zeros_for_empty_prompt), as ours."""
    pipe = StableDiffusionXLPipeline(
        vae=model.vae,
        text_encoder=model.text_encoder,
        text_encoder_2=model.text_encoder_2,
        tokenizer=model.tokenizer,
        tokenizer_2=model.tokenizer_2,
        unet=model.unet,
        scheduler=EulerDiscreteScheduler.from_config(model.noise_scheduler.config),
    )
    prompts = ["a red circle", "a small green square on the left"]
    embeds, negative, pooled, negative_pooled = pipe.encode_prompt(prompts, device="cpu")
    context, ours_pooled = model.encode_captions(prompts, "cpu")
    assert context.shape == (2, 77, 64) and ours_pooled.shape == (2, 32)
    torch.testing.assert_close(context, embeds, rtol=0, atol=0)
    torch.testing.assert_close(ours_pooled, pooled, rtol=0, atol=0)
    condition = model.prompt_condition(prompts, None, (32, 32), "cpu")
    assert condition["encoder_hidden_states"][:2].eq(0).all() and negative.eq(0).all()
    assert condition["added_cond_kwargs"]["text_embeds"][:2].eq(0).all() and negative_pooled.eq(0).all()
    # The pipeline's add_time_ids for a 32 px image, uncropped, at its own size.
    expected = torch.tensor([[32.0, 32.0, 0.0, 0.0, 32.0, 32.0]] * 4)
    assert condition["added_cond_kwargs"]["time_ids"].equal(expected)


def _unet_inputs(model, batch) -> dict:
    """The keyword arguments the UNet gets in a training forward of `batch`."""
    seen = {}

    def hook(module, args, kwargs):
        seen.update(kwargs)

    handle = model.unet.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        model(batch)
    finally:
        handle.remove()
    return seen


def test_micro_conditioning_reaches_the_unet_in_sdxl_order(model):
    """(orig_h, orig_w, crop_top, crop_left, target_h, target_w) per sample, the target being the
    training image's size; a batch without the keys gets its own size and no crop."""
    batch = _batch(
        model,
        ["a", "b"],
        size=32,
        original_size=torch.tensor([[480, 640], [1024, 768]]),
        crop_top_left=torch.tensor([[0, 80], [37, 0]]),
    )
    time_ids = _unet_inputs(model, batch)["added_cond_kwargs"]["time_ids"]
    assert time_ids.tolist() == [[480, 640, 0, 80, 32, 32], [1024, 768, 37, 0, 32, 32]]
    wide = _batch(model, ["a"], size=32)
    wide["image"] = torch.rand(1, 3, 32, 64) * 2 - 1
    time_ids = _unet_inputs(model, wide)["added_cond_kwargs"]["time_ids"]
    assert time_ids.tolist() == [[32, 64, 0, 0, 32, 64]]


@pytest.mark.heavy
def test_flops_count_the_sdxl_unet_with_its_added_conditioning():
    from models.flops import training_flops_per_image

    flops = training_flops_per_image("sdxl-base", 1024)
    # SDXL's UNet forward is ~6.7 TFLOP at 1024 px (128x128 latents); training is 3x the forward.
    assert 18e12 < flops < 22e12


def test_sdxl_presets_name_both_tokenizers_paddings():
    assert PRESETS["sdxl-base"]["pad_token"] == "<|endoftext|>"  # CLIP ViT-L's tokenizer/
    assert PRESETS["sdxl-base"]["pad_token_2"] == "!"  # OpenCLIP bigG's tokenizer_2/
    model = build_model("sdxl-tiny")
    assert (model.tokenizer.pad_token, model.tokenizer_2.pad_token) == ("<|endoftext|>", "!")


@pytest.mark.fit
def test_tiny_sdxl_recipe_trains_on_the_shapes(shapes_mds):
    """yamls/tiny-sdxl-cpu.yaml, shortened: the data path hands over both token ids and the
    micro-conditioning, and the loss goes down over 8 batches."""
    trainer = build_trainer(load_config(REPO / "yamls/tiny-sdxl-cpu.yaml", tiny_run(shapes_mds, 8)))
    losses = []
    from composer import Callback

    class Losses(Callback):
        def after_loss(self, state, logger):
            losses.append(float(state.loss))

        def before_forward(self, state, logger):
            assert {"input_ids_2", "original_size", "crop_top_left"} <= state.batch.keys()

    trainer.state.callbacks.append(Losses())
    trainer.fit()
    trainer.close()
    assert len(losses) == 8 and all(torch.isfinite(torch.tensor(losses)))
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3


def test_vae_encodes_in_fp32_under_fp16_autocast(model):
    """SDXL's VAE overflows in fp16 (force_upcast): under fp16 autocast the moments are the fp32 ones."""
    images = torch.rand(2, 3, 32, 32) * 2 - 1
    reference = model.vae_moments(images)
    with torch.autocast("cpu", dtype=torch.float16):
        under_fp16 = model.vae_moments(images)
    assert under_fp16.dtype == torch.float32 and under_fp16.equal(reference)


def test_latents_converted_for_another_family_are_named(model):
    batch = {"latents": torch.zeros(1, 8, 4, 4), "text_embeds": torch.zeros(1, 77, 64)}
    with pytest.raises(ValueError, match="sd-convert latents --preset sdxl-base"):
        model(batch)
