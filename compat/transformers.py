"""transformers internals we rely on, written for transformers 4.57.6.

- A slow tokenizer's `_added_tokens_decoder` (id -> AddedToken) and `_added_tokens_encoder`
  (content -> id): models/tokenizer.py's fast CLIP tokenization needs the added tokens as the slow
  tokenizer stores them (the public `added_tokens_*` properties build sorted copies on each call).
- Modules below the public package: `transformers.models.clip.tokenization_clip` (bytes_to_unicode,
  whitespace_clean: the slow CLIP tokenizer's byte alphabet and text cleaning, which the fast path
  must match), `transformers.convert_slow_tokenizer.convert_slow_tokenizer` (the tokenizers backend
  built from a slow tokenizer) and `transformers.integrations.accelerate.init_empty_weights`
  (build models on the meta device: export and tests load weights without a random init first).
"""

from transformers.convert_slow_tokenizer import convert_slow_tokenizer
from transformers.integrations.accelerate import init_empty_weights
from transformers.models.clip.tokenization_clip import bytes_to_unicode, whitespace_clean

__all__ = [
    "added_tokens_decoder",
    "added_tokens_encoder",
    "bytes_to_unicode",
    "convert_slow_tokenizer",
    "init_empty_weights",
    "whitespace_clean",
]


def added_tokens_decoder(tokenizer) -> dict:
    """A slow tokenizer's added tokens, id -> AddedToken (its own dict: do not modify)."""
    return tokenizer._added_tokens_decoder


def added_tokens_encoder(tokenizer) -> dict[str, int]:
    """A slow tokenizer's added tokens, content -> id (its own dict: do not modify)."""
    return tokenizer._added_tokens_encoder
