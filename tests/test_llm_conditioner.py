"""The LLM conditioner (models/engine/llm_conditioner.py) gives what the pipelines give their
transformers, bit for bit on the CPU: Z-Image's unpadded second-to-last hidden states
(ZImagePipeline._encode_prompt) and FLUX.2 klein's three layers side by side with the padded rows kept
(Flux2KleinPipeline._get_qwen3_prompt_embeds), from a toy Qwen3 and the offline tokenizer."""

from types import SimpleNamespace

import torch
from diffusers import Flux2KleinPipeline, ZImagePipeline
from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3Model

from models.engine.llm_conditioner import PADDING, LLMHiddenStates, build_llm_tokenizer, unpadded
from models.families.zimage.presets import ZIMAGE

PROMPTS = ["a red circle", "a small blue square on the left", ""]
LENGTH = 24


def _parts(encoder_class):
    torch.manual_seed(0)
    config = dict(ZIMAGE["zimage-tiny"]["text_encoder"], num_hidden_layers=4)
    encoder = encoder_class(Qwen3Config(**config)).eval()
    return SimpleNamespace(text_encoder=encoder, tokenizer=build_llm_tokenizer(), text_tokens=LENGTH)


def test_ids_carry_the_tokenizer_s_mask_and_z_image_s_context_is_its_pipeline_s():
    parts, conditioner = _parts(Qwen3Model), LLMHiddenStates()
    ids = conditioner.ids(parts, PROMPTS)["input_ids"]
    assert ids.shape == (3, LENGTH) and (ids[:, -1] == PADDING).all() and (ids[:, 0] != PADDING).all()
    ours = unpadded(conditioner.encode(parts, {"input_ids": ids})["text_embeds"])
    pipe = SimpleNamespace(tokenizer=parts.tokenizer, text_encoder=parts.text_encoder)
    theirs = ZImagePipeline._encode_prompt(pipe, list(PROMPTS), "cpu", max_sequence_length=LENGTH)
    assert [t.shape for t in ours] == [t.shape for t in theirs]
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs, strict=True))


def test_flux2_klein_s_context_is_its_pipeline_s():
    parts = _parts(Qwen3ForCausalLM)
    conditioner = LLMHiddenStates(layers=(1, 2, 3), thinking=False, keep_padding=True)
    ours = conditioner.encode(parts, conditioner.ids(parts, PROMPTS))["text_embeds"]
    theirs = Flux2KleinPipeline._get_qwen3_prompt_embeds(
        parts.text_encoder, parts.tokenizer, list(PROMPTS), max_sequence_length=LENGTH,
        hidden_states_layers=(1, 2, 3),
    )  # fmt: skip
    assert ours.shape == theirs.shape == (3, LENGTH, 3 * 32)
    assert torch.equal(ours, theirs)
