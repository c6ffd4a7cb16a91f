"""transformers internals we rely on, written for transformers 5.24.0.

- `transformers.convert_slow_tokenizer.bytes_to_unicode`: CLIP's byte alphabet (GPT-2's byte-to-unicode
  table), from which models/engine/tokenizer.py builds the CLIP vocabulary offline. transformers 4 kept it in
  `models.clip.tokenization_clip` beside the slow tokenizer that version 5 removed.
"""

from transformers.convert_slow_tokenizer import bytes_to_unicode

__all__ = ["bytes_to_unicode"]
