"""Offline CLIP BPE tokenizer.

Stable Diffusion 2 tokenizes with OpenCLIP's BPE (the same merges as OpenAI CLIP). open_clip_torch
ships that vocabulary (`bpe_simple_vocab_16e6.txt.gz`), so we derive a transformers `CLIPTokenizer`
from it instead of downloading `tokenizer/` from a hub. The result saves with `save_pretrained` and
is what an exported diffusers pipeline carries. Since transformers 5 `CLIPTokenizer` is the Rust
(`tokenizers`) one, the tokenizer diffusers' pipelines use: NFC, whitespace and lower-case clean-up but
no ftfy, so curly quotes, HTML entities and full-width characters get other ids than open_clip's (and
transformers 4's slow tokenizer's) gave; training and inference use the same one.

`build_t5_tokenizer` is a T5 tokenizer built offline for the tiny T5 presets (`mmdit-tiny-t5`): no T5
tokenizer files ship with transformers, and T5's sentencepiece model is a download. A `tokenizers`
Unigram model over a small vocabulary (the synthetic shapes' words, then letters and digits for
anything else), wrapped as a transformers T5TokenizerFast: it saves with `save_pretrained` into an
exported pipeline and loads back with `from_pretrained`, as a real T5 tokenizer does.
"""

import gzip
import importlib.util
from pathlib import Path

import torch
from transformers import CLIPTokenizer, T5TokenizerFast

from compat.transformers import bytes_to_unicode

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


def _vocab_and_merges() -> tuple[dict[str, int], list[tuple[str, str]]]:
    lines = gzip.open(default_bpe()).read().decode("utf-8").split("\n")
    merges = lines[1 : _NUM_MERGES + 1]
    byte_tokens = list(bytes_to_unicode().values())
    tokens = byte_tokens + [t + "</w>" for t in byte_tokens]
    tokens += ["".join(m.split()) for m in merges]
    tokens += ["<|startoftext|>", "<|endoftext|>"]
    return {t: i for i, t in enumerate(tokens)}, [tuple(m.split()) for m in merges]


def build_tokenizer(pad_token: str = "!") -> CLIPTokenizer:
    """A CLIPTokenizer with 49,408 tokens, built with no network access.

    `pad_token="!"` (id 0) is SD2's padding, matching open_clip which pads with zeros; SD1 pads
    with `<|endoftext|>` instead.
    """
    vocab, merges = _vocab_and_merges()
    return CLIPTokenizer(vocab=vocab, merges=merges, pad_token=pad_token, model_max_length=MAX_LENGTH)


# The toy T5 vocabulary after <pad> (0), </s> (1) and <unk> (2): whole words of the synthetic shapes'
# captions (data/synthetic.py) and a few common ones, then single letters and digits, so that any
# lower-case caption has ids (upper case and punctuation fall back to <unk>). Changing it changes the
# ids of every mmdit-tiny-t5 checkpoint: append only.
T5_WORDS = (
    "a an the of on in with and red green blue yellow purple orange black white circle square triangle "
    "small large big left right top bottom photo picture shape"
).split()
T5_CHARACTERS = "abcdefghijklmnopqrstuvwxyz0123456789"
# <pad>, </s>, <unk>, the bare word boundary "▁", the words and the characters: the tiny T5's vocab_size.
T5_VOCAB_SIZE = 4 + len(T5_WORDS) + len(T5_CHARACTERS)
T5_MAX_LENGTH = 512  # what the SD3 and Flux pipelines allow for T5 (its model_max_length)


def build_t5_tokenizer() -> T5TokenizerFast:
    """A T5TokenizerFast over `T5_WORDS` and `T5_CHARACTERS` (len() = the tiny T5's vocab_size), built
    with no network access: NFKC normalisation, SentencePiece's "▁" word boundaries (Metaspace), and
    </s> appended to each sequence, as T5's own tokenizer does."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

    vocab = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("▁", -3.0)]
    # Whole words score above their spellings, so the Unigram model's best split keeps them whole.
    vocab += [("▁" + word, -1.0) for word in T5_WORDS]
    vocab += [(character, -5.0) for character in T5_CHARACTERS]
    backend = Tokenizer(models.Unigram(vocab, unk_id=2))
    backend.normalizer = normalizers.NFKC()
    backend.pre_tokenizer = pre_tokenizers.Metaspace()
    backend.decoder = decoders.Metaspace()
    backend.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
    return T5TokenizerFast(
        tokenizer_object=backend,
        eos_token="</s>",
        pad_token="<pad>",
        unk_token="<unk>",
        extra_ids=0,
        model_max_length=T5_MAX_LENGTH,
    )


def tokenize_t5(tokenizer, captions: list[str], length: int) -> torch.Tensor:
    """T5 token ids (len(captions), length), as StableDiffusion3Pipeline tokenizes with
    max_sequence_length=length: </s> appended, padded and truncated to `length`."""
    return tokenizer(
        captions,
        padding="max_length",
        max_length=length,
        truncation=True,
        add_special_tokens=True,
        return_tensors="pt",
    ).input_ids


def tokenize(tokenizer: CLIPTokenizer, captions: list[str]):
    """Token ids padded/truncated to 77, as a LongTensor of shape (len(captions), 77)."""
    return tokenizer(
        captions,
        padding="max_length",
        max_length=MAX_LENGTH,
        truncation=True,
        return_tensors="pt",
    ).input_ids
