"""Offline CLIP BPE tokenizer.

Stable Diffusion 2 tokenizes with OpenCLIP's BPE (the same merges as OpenAI CLIP). open_clip_torch
ships that vocabulary (`bpe_simple_vocab_16e6.txt.gz`), so we derive a transformers `CLIPTokenizer`
from it instead of downloading `tokenizer/` from a hub. The result saves with `save_pretrained` and
is what an exported diffusers pipeline carries.
"""

import gzip
import importlib.util
import json
import tempfile
from pathlib import Path

from transformers import CLIPTokenizer
from transformers.models.clip.tokenization_clip import bytes_to_unicode

MAX_LENGTH = 77  # CLIP's context length
# CLIP keeps the first 49152 - 256 - 2 lines of the BPE file (line 0 is a version header); the
# same slice as open_clip.tokenizer.SimpleTokenizer and transformers.CLIPTokenizer use.
_NUM_MERGES = 49152 - 256 - 2


def default_bpe() -> Path:
    """open_clip_torch's packaged BPE file, found without importing open_clip: its import pulls in
    timm and wandb (about 3.5 s of every process start, measured with python -X importtime)."""
    spec = importlib.util.find_spec("open_clip")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError("open_clip_torch is not installed; it ships the CLIP BPE vocabulary")
    return Path(spec.submodule_search_locations[0], "bpe_simple_vocab_16e6.txt.gz")


def _vocab_and_merges() -> tuple[dict[str, int], str]:
    lines = gzip.open(default_bpe()).read().decode("utf-8").split("\n")
    merges = lines[1 : _NUM_MERGES + 1]
    byte_tokens = list(bytes_to_unicode().values())
    tokens = byte_tokens + [t + "</w>" for t in byte_tokens]
    tokens += ["".join(m.split()) for m in merges]
    tokens += ["<|startoftext|>", "<|endoftext|>"]
    return {t: i for i, t in enumerate(tokens)}, "\n".join(["#version: 0.2", *merges])


def build_tokenizer(pad_token: str = "!") -> CLIPTokenizer:
    """A CLIPTokenizer with 49,408 tokens, built with no network access.

    `pad_token="!"` (id 0) is SD2's padding, matching open_clip which pads with zeros; SD1 pads
    with `<|endoftext|>` instead.
    """
    vocab, merges = _vocab_and_merges()
    with tempfile.TemporaryDirectory() as tmp:
        vocab_file, merges_file = Path(tmp, "vocab.json"), Path(tmp, "merges.txt")
        vocab_file.write_text(json.dumps(vocab))
        merges_file.write_text(merges)
        return CLIPTokenizer(
            vocab_file=str(vocab_file),
            merges_file=str(merges_file),
            pad_token=pad_token,
            model_max_length=MAX_LENGTH,
        )


def tokenize(tokenizer: CLIPTokenizer, captions: list[str]):
    """Token ids padded/truncated to 77, as a LongTensor of shape (len(captions), 77)."""
    return tokenizer(
        captions,
        padding="max_length",
        max_length=MAX_LENGTH,
        truncation=True,
        return_tensors="pt",
    ).input_ids
