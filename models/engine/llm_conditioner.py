"""The conditioner of the families whose text encoder is a decoder LLM (Z-Image's Qwen3-4B): the
caption as the pipeline's chat prompt, its hidden states at one layer as the context, padding left out.
As models/engine/conditioners.py's, it serves the model, the data loader and `sd-convert latents` with
the same tensors.

ZImagePipeline._encode_prompt wraps each prompt in the tokenizer's chat template (one user message, the
generation prompt, thinking on), tokenizes it padded to `max_sequence_length`, runs the encoder with the
attention mask and keeps `hidden_states[-2]` at the unpadded positions: a list of (L_i, D) tensors.
Here the same, with fixed shapes so that batches collate and `sd-convert latents` stores one column:
- token ids (B, text_tokens) with -1 where the tokenizer padded (no token id is negative), so the mask
  travels inside the ids column and is exactly the tokenizer's attention mask, on either padding side;
- the stored form `text_embeds` (B, text_tokens, D) with zeros at the padded positions; the model takes
  the unpadded rows back out (`unpadded`: a row of a real token is never all zeros) and hands the
  transformer the pipeline's list.

`build_llm_tokenizer` is a Qwen2Tokenizer built offline for the tiny presets: the byte-level BPE class the
Qwen3 folders ship, over a small vocabulary (the shapes' words whole, every byte for anything else), with
Qwen3's chat markers and a chat template that writes what Qwen3's own writes for one user message.
"""

import torch
from transformers import Qwen2Tokenizer

from models.engine.tokenizer import T5_WORDS

PADDING = -1  # the ids column's mark of a padded position
# ZImagePipeline: hidden_states[-2], the encoder's second-to-last layer's output.
HIDDEN_LAYER = -2
# What Qwen3's chat template writes for [{"role": "user", "content": c}] with add_generation_prompt and
# enable_thinking=True (ZImagePipeline's call): the template adds an empty think block only when
# thinking is off.
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")  # Qwen's padding and chat markers


class LLMHiddenStates:
    """`text_encoder` (a decoder LLM: transformers' Qwen3Model) and `tokenizer` with its chat template;
    the holder's `text_tokens` is the length the tokenizer pads to (the pipeline's max_sequence_length).

    Z-Image's by default. `layers`: the hidden_states taken, side by side per token (FLUX.2 klein's
    9, 18, 27: Flux2KleinPipeline._get_qwen3_prompt_embeds); `thinking`: the chat template's
    enable_thinking; `keep_padding`: the padded rows stay as the encoder computed them and the
    denoiser gets all of them (klein's), instead of zeros that the model drops (Z-Image's)."""

    text_parts: tuple[str, ...] = ("text_encoder", "tokenizer")
    pooled = False  # no global vector
    reads_t5 = False

    def __init__(self, layers: tuple[int, ...] = (HIDDEN_LAYER,), thinking: bool = True, keep_padding=False):
        self.layers, self.thinking, self.keep_padding = tuple(layers), thinking, keep_padding

    def ids(self, parts, captions: list[str]) -> dict[str, torch.Tensor]:
        """(B, text_tokens) ids of the captions' chat prompts, PADDING where the tokenizer padded."""
        tokenizer = parts.tokenizer
        prompts = [
            tokenizer.apply_chat_template(
                [{"role": "user", "content": caption}],
                tokenize=False,
                add_generation_prompt=True,
                enable_thinking=self.thinking,
            )
            for caption in captions
        ]
        tokens = tokenizer(
            prompts, padding="max_length", max_length=parts.text_tokens, truncation=True, return_tensors="pt"
        )
        return {"input_ids": tokens.input_ids.masked_fill(~tokens.attention_mask.bool(), PADDING)}

    def id_lengths(self, parts) -> dict[str, int]:
        return {"input_ids": parts.text_tokens}

    @torch.no_grad()
    def encode(self, parts, ids) -> dict[str, torch.Tensor]:
        """`text_embeds`: the encoder's outputs at `layers` (side by side) with the attention mask of the
        ids; zeros where padded unless `keep_padding`."""
        input_ids = ids["input_ids"]
        mask = input_ids != PADDING
        pad = parts.tokenizer.pad_token_id if parts.tokenizer is not None else 0
        # On the meta device (shapes, FLOPs: models/flop_count.py) no mask: transformers reads the mask's
        # values to choose its attention path, and the full context is what is counted anyway.
        states = parts.text_encoder(
            input_ids=input_ids.masked_fill(~mask, pad),
            attention_mask=None if input_ids.is_meta else mask,
            output_hidden_states=True,
        ).hidden_states
        hidden = torch.cat([states[k] for k in self.layers], dim=-1)  # klein's stack + reshape, per token
        return {"text_embeds": hidden if self.keep_padding else hidden.masked_fill(~mask[..., None], 0.0)}

    def loader_inputs(self, parts) -> dict:
        """The loader tokenizes captions with `ids` (data/image_caption.py's `caption_ids`)."""
        return {"caption_ids": CaptionIds(self, parts.tokenizer, parts.text_tokens)}

    def offline_tokenizers(self) -> dict:
        """The tokenizers a preset with `bundled_text` builds offline (models/build.py)."""
        return {"tokenizer": build_llm_tokenizer()}


class CaptionIds:
    """One caption -> the loader's columns (`LLMHiddenStates.ids`), picklable for DataLoader workers."""

    def __init__(self, conditioner: LLMHiddenStates, tokenizer, text_tokens: int):
        self.conditioner, self.tokenizer, self.text_tokens = conditioner, tokenizer, text_tokens

    def __call__(self, caption: str) -> dict[str, torch.Tensor]:
        return {name: value[0] for name, value in self.conditioner.ids(self, [caption]).items()}


def unpadded(text_embeds: torch.Tensor) -> list[torch.Tensor]:
    """Each caption's rows without the padded ones (all zeros), as the pipeline's prompt_embeds list."""
    keep = (text_embeds != 0).any(dim=-1)
    return [row[mask] for row, mask in zip(text_embeds, keep, strict=True)]


def build_llm_tokenizer() -> Qwen2Tokenizer:
    """A Qwen2Tokenizer over the 256 byte symbols, every prefix of the shapes' words (so each word is
    one token) and Qwen's special tokens, with CHAT_TEMPLATE; built with no network access. Its ids are
    part of every zimage-tiny checkpoint: change nothing here but by appending words."""
    from compat.transformers import bytes_to_unicode

    symbols = list(bytes_to_unicode().values())
    merges, pieces = [], []
    for word in ["Ġ" + w for w in T5_WORDS] + list(T5_WORDS) + ["user", "assistant", "ĊĊ"]:
        for end in range(2, len(word) + 1):
            merge = (word[: end - 1], word[end - 1])
            if merge not in merges:
                merges.append(merge)
                pieces.append(word[:end])
    vocab = {symbol: i for i, symbol in enumerate(symbols + pieces + list(SPECIAL))}
    tokenizer = Qwen2Tokenizer(vocab=vocab, merges=merges, model_max_length=131072)
    tokenizer.add_special_tokens({"additional_special_tokens": list(SPECIAL[1:])})
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer
