"""Conditioners: a family's frozen text encoders and tokenizers -> the tensors its denoiser is
conditioned on, written once for the three places that need them: the model (token ids -> condition),
the data loader (which token-id columns to produce) and `sd-convert latents` (the values of the
columns it stores; which ones: `pooled`, `reads_t5`, convert/latents.columns). Each takes the module
holder as `parts` (a model, or convert/encoders.Encoders: anything with the named attributes), so
the same call makes the same tensors in all three.

What a conditioner gives (`encode`) is what `sd-convert latents` stores, the "stored form":
`text_embeds` (the context the denoiser attends to, before any padding), `pooled_text_embeds` (a global
vector, when the family has one) and `text_embeds_3` (T5's context, when the model has a T5). The
model turns the stored form into its denoiser's keywords (models/families/sd/model.py, sdxl.py,
mmdit.py: `condition`), from the batch's precomputed columns or from `encode` of its token ids alike,
so both paths give the same loss.

  CLIPText        SD1/SD2: one CLIP's last hidden states (77, D).
  TwoCLIPs        SDXL: both CLIPs' penultimate hidden states side by side (77, D1 + D2) and the
                  second's projected pooled output, as StableDiffusionXLPipeline.encode_prompt.
  CLIPsAndT5      SD3-style MMDiT: SDXL's context, both CLIPs' pooled outputs side by side, and
                  optionally T5's last hidden states (t5_tokens, D3), as StableDiffusion3Pipeline.
  PooledCLIPAndT5 Flux: T5's last hidden states as the context (t5_tokens, D) and CLIP ViT-L's pooled
                  output (no projection) as the global vector, as FluxPipeline.encode_prompt.
"""

import torch

from models.engine.tokenizer import MAX_LENGTH, tokenize, tokenize_t5

# The data loader's column of T5's ids (data/image_caption.py, from its `t5_tokenizer` keyword), whichever
# component of a family holds T5.
T5_IDS = "input_ids_3"


class CLIPText:
    """One CLIP text encoder (`text_encoder`, `tokenizer`): its last hidden states."""

    text_parts: tuple[str, ...] = ("text_encoder", "tokenizer")
    pooled = False  # the stored form has a pooled vector (`pooled_text_embeds`)
    reads_t5 = False  # a model of this family may have a T5 (text_encoder_3)

    def ids(self, parts, captions: list[str]) -> dict[str, torch.Tensor]:
        """Token ids of `captions` under the columns the data loader produces (data/image_caption.py)."""
        return {"input_ids": tokenize(parts.tokenizer, captions)}

    def id_lengths(self, parts) -> dict[str, int]:
        """`ids`' columns and their lengths in tokens, without a tokenizer: what `encode` reads (for
        meta-device shapes and FLOPs: models/stored_form.py)."""
        return {"input_ids": MAX_LENGTH}

    @torch.no_grad()
    def encode(self, parts, ids) -> dict[str, torch.Tensor]:
        """The stored form of token ids (`ids`: a batch or `self.ids(...)`, on the encoders' device)."""
        return {"text_embeds": parts.text_encoder(ids["input_ids"])[0]}

    def loader_inputs(self, parts) -> dict:
        """What the image data path needs besides the first tokenizer (data/loader.py's keywords)."""
        return {}


class TwoCLIPs(CLIPText):
    """SDXL's: `text_encoder` (CLIP ViT-L) and `text_encoder_2` (OpenCLIP bigG, with projection)."""

    text_parts = ("text_encoder", "tokenizer", "text_encoder_2", "tokenizer_2")
    pooled = True

    def ids(self, parts, captions: list[str]) -> dict[str, torch.Tensor]:
        return {**super().ids(parts, captions), "input_ids_2": tokenize(parts.tokenizer_2, captions)}

    def id_lengths(self, parts) -> dict[str, int]:
        return {**super().id_lengths(parts), "input_ids_2": MAX_LENGTH}

    @torch.no_grad()
    def hidden(self, parts, ids) -> tuple[torch.Tensor, object, object]:
        """(context, first's output, second's output): the context is both encoders' penultimate
        hidden states side by side."""
        first = parts.text_encoder(ids["input_ids"], output_hidden_states=True)
        second = parts.text_encoder_2(ids["input_ids_2"], output_hidden_states=True)
        return torch.cat([first.hidden_states[-2], second.hidden_states[-2]], dim=-1), first, second

    @torch.no_grad()
    def encode(self, parts, ids) -> dict[str, torch.Tensor]:
        context, _, second = self.hidden(parts, ids)
        return {"text_embeds": context, "pooled_text_embeds": second.text_embeds}

    def loader_inputs(self, parts) -> dict:
        return {"tokenizer_2": parts.tokenizer_2}


class CLIPsAndT5(TwoCLIPs):
    """SD3's: both CLIPs (each with projection) and, when the holder's `text_encoder_3` is set, T5
    (`tokenizer_3`, `t5_tokens` long)."""

    reads_t5 = True

    def ids(self, parts, captions: list[str]) -> dict[str, torch.Tensor]:
        ids = super().ids(parts, captions)
        if parts.text_encoder_3 is not None:
            ids["input_ids_3"] = tokenize_t5(parts.tokenizer_3, captions, parts.t5_tokens)
        return ids

    def id_lengths(self, parts) -> dict[str, int]:
        lengths = super().id_lengths(parts)
        if parts.text_encoder_3 is not None:
            lengths["input_ids_3"] = parts.t5_tokens
        return lengths

    @torch.no_grad()
    def encode(self, parts, ids) -> dict[str, torch.Tensor]:
        clip, first, second = self.hidden(parts, ids)
        stored = {
            "text_embeds": clip,
            "pooled_text_embeds": torch.cat([first.text_embeds, second.text_embeds], -1),
        }
        if parts.text_encoder_3 is not None:
            if ids.get("input_ids_3") is None:
                raise ValueError("this model reads T5 (text_encoder_3): the batch needs input_ids_3")
            stored["text_embeds_3"] = parts.text_encoder_3(ids["input_ids_3"])[0]
        return stored

    def loader_inputs(self, parts) -> dict:
        inputs = super().loader_inputs(parts)
        if parts.text_encoder_3 is not None:
            inputs.update(t5_tokenizer=parts.tokenizer_3, t5_tokens=parts.t5_tokens)
        return inputs


class PooledCLIPAndT5(CLIPText):
    """Flux's: `text_encoder` (CLIP ViT-L, CLIPTextModel) gives only its pooled output (the final
    norm's end-of-text token, unprojected), `text_encoder_2` (T5) with `tokenizer_2` reads `t5_tokens`
    tokens of the caption and its last hidden states are the whole context, as FluxPipeline's
    `_get_clip_prompt_embeds` and `_get_t5_prompt_embeds` (max_sequence_length=t5_tokens). T5's ids
    travel in the loader's T5 column (T5_IDS)."""

    text_parts = ("text_encoder", "tokenizer", "text_encoder_2", "tokenizer_2")
    pooled = True

    def ids(self, parts, captions: list[str]) -> dict[str, torch.Tensor]:
        return {
            **super().ids(parts, captions),
            T5_IDS: tokenize_t5(parts.tokenizer_2, captions, parts.t5_tokens),
        }

    def id_lengths(self, parts) -> dict[str, int]:
        return {**super().id_lengths(parts), T5_IDS: parts.t5_tokens}

    @torch.no_grad()
    def encode(self, parts, ids) -> dict[str, torch.Tensor]:
        if ids.get(T5_IDS) is None:
            raise ValueError(f"this model reads T5 (text_encoder_2): the batch needs its ids, {T5_IDS}")
        return {
            "text_embeds": parts.text_encoder_2(ids[T5_IDS])[0],
            "pooled_text_embeds": parts.text_encoder(ids["input_ids"]).pooler_output,
        }

    def loader_inputs(self, parts) -> dict:
        return {"t5_tokenizer": parts.tokenizer_2, "t5_tokens": parts.t5_tokens}
