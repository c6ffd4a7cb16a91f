"""SDXL: the Stable Diffusion ComposerModel with SDXL's conditioning (Podell et al. 2023).

What differs from SD1/SD2 (models/families/sd/model.py), and nothing else does (the DDPM objective,
latents, seeded validation, guidance and samplers are the base class's):
- Two frozen text encoders. The UNet attends to both encoders' penultimate hidden states side by side
  (CLIP ViT-L's 768 then OpenCLIP bigG's 1280 = 2048 wide), and takes bigG's pooled, projected
  output (1280) as a second, global condition, as diffusers' StableDiffusionXLPipeline computes them.
- Micro-conditioning: each sample's original size, the top-left corner of its crop and the target
  size, (orig_h, orig_w, crop_top, crop_left, target_h, target_w), embedded beside the pooled text.
  The data path hands over `original_size` and `crop_top_left` (data/image_caption.py); the target
  is the training image's own size. A batch without them gets (H, W) and (0, 0): an uncropped image
  at its own size, which is also what generation asks for by default.
- Caption dropout zeroes a dropped sample's context and pooled vector (SDXL's training code zeroes
  dropped embeddings), and unconditional generation uses the same zeros (the pipeline's
  `force_zeros_for_empty_prompt`), so guidance pushes away from what training dropped to. A model
  fine-tuned from a folder whose pipeline sets that flag false uses the empty caption's embeddings
  for both instead, as that pipeline samples.

Batch keys beyond the base class's: `input_ids_2` (tokenizer_2's ids), or with precomputed latents
`pooled_text_embeds`; `original_size` and `crop_top_left` (LongTensor (B, 2) each), optional.
"""

import torch

from models.engine.conditioners import TwoCLIPs
from models.families.sd.model import StableDiffusion


class StableDiffusionXL(StableDiffusion):
    """`text_encoder_2` (a CLIPTextModelWithProjection) and `tokenizer_2` join the base class's parts."""

    micro_conditioning = True
    conditioner = TwoCLIPs()

    def __init__(
        self,
        unet,
        vae,
        text_encoder,
        tokenizer,
        noise_scheduler,
        *,
        text_encoder_2,
        tokenizer_2,
        force_zeros_for_empty_prompt: bool = True,
        **kw,
    ):
        super().__init__(unet, vae, text_encoder, tokenizer, noise_scheduler, **kw)
        self.text_encoder_2 = text_encoder_2.requires_grad_(False).eval()
        self.tokenizer_2 = tokenizer_2
        self.text_encoder_2._fsdp_wrap = False
        # The unconditional condition: zeros (SDXL base's pipeline), or the empty caption's embeddings.
        self.force_zeros_for_empty_prompt = bool(force_zeros_for_empty_prompt)

    def train(self, mode: bool = True):
        super().train(mode)
        self.text_encoder_2.eval()
        return self

    # -- conditioning ----------------------------------------------------------------------------
    def encode_text(
        self, input_ids: torch.Tensor, input_ids_2: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(context (B, 77, D1 + D2), pooled (B, P)): both encoders' penultimate hidden states and the
        second encoder's projected pooled output, as StableDiffusionXLPipeline.encode_prompt makes them."""
        stored = self.conditioner.encode(self, {"input_ids": input_ids, "input_ids_2": input_ids_2})
        return stored["text_embeds"], stored["pooled_text_embeds"]

    def encode_captions(self, captions: list[str], device) -> tuple[torch.Tensor, torch.Tensor]:
        ids = self.conditioner.ids(self, captions)
        return self.encode_text(ids["input_ids"].to(device), ids["input_ids_2"].to(device))

    def unconditional(self, n: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        """(context, pooled) of the unconditional branch for n samples: zeros, or with
        force_zeros_for_empty_prompt false the empty caption's (LatentDiffusion.empty_stored: encoded,
        or the precomputed set's), made once per device."""
        key = ("unconditional", torch.device(device))  # beside StableDiffusion's own in self._empty
        if key not in self._empty:
            stored = self.empty_stored(key[1])
            context, pooled = stored["text_embeds"], stored["pooled_text_embeds"]
            if self.force_zeros_for_empty_prompt:
                context, pooled = torch.zeros_like(context), torch.zeros_like(pooled)
            self._empty[key] = (context, pooled)
        context, pooled = self._empty[key]
        return context.expand(n, -1, -1), pooled.expand(n, -1)

    def time_ids(self, batch, n: int, image_size: tuple[int, int], device) -> torch.Tensor:
        """(n, 6) floats: (orig_h, orig_w, crop_top, crop_left, target_h, target_w) per sample."""
        target = torch.tensor(image_size, device=device).expand(n, 2)
        original = batch.get("original_size")
        original = target if original is None else original.to(device)
        crop = batch.get("crop_top_left")
        crop = torch.zeros_like(target) if crop is None else crop.to(device)
        return torch.cat([original, crop, target], dim=1).float()

    @torch.no_grad()
    def vae_moments(self, images: torch.Tensor) -> torch.Tensor:
        """As the base class's, but never under fp16 autocast: SDXL's VAE overflows in fp16 (its
        config's `force_upcast`, which diffusers' pipelines honour by running it in fp32)."""
        device = images.device.type
        if torch.is_autocast_enabled(device) and torch.get_autocast_dtype(device) == torch.float16:
            with torch.autocast(device, enabled=False):
                return super().vae_moments(images)
        return super().vae_moments(images)

    def condition(self, batch, drop_captions: bool, image_size: tuple[int, int]) -> dict:
        if "text_embeds" in batch:
            if "pooled_text_embeds" not in batch:
                raise ValueError(
                    "the batch's precomputed latents have no pooled_text_embeds: they were converted for "
                    "another model family; convert them with `sd-convert latents --preset sdxl-base`"
                )
            context, pooled = batch["text_embeds"].float(), batch["pooled_text_embeds"].float()
        else:
            context, pooled = self.encode_text(batch["input_ids"], batch["input_ids_2"])
        n, device = context.shape[0], context.device
        if drop_captions:
            context, pooled = self.caption_dropout([context, pooled], lambda: self.unconditional(n, device))
        added = {"text_embeds": pooled, "time_ids": self.time_ids(batch, n, image_size, device)}
        return {"encoder_hidden_states": context, "added_cond_kwargs": added}

    def pipeline_parts(self) -> dict:
        """StableDiffusionXLPipeline's keywords: no safety checker, both text encoders."""
        parts = super().pipeline_parts()
        for key in ("safety_checker", "feature_extractor", "requires_safety_checker"):
            del parts[key]
        return dict(
            parts,
            text_encoder_2=self.text_encoder_2,
            tokenizer_2=self.tokenizer_2,
            # The unconditional condition caption dropout trained: zeros, or the empty caption's.
            force_zeros_for_empty_prompt=self.force_zeros_for_empty_prompt,
            add_watermarker=False,  # not saved in the folder; a loader decides for itself
        )

    # -- sampling --------------------------------------------------------------------------------
    def prompt_condition(self, prompts: list[str], negative_prompt: str | None, image_size, device) -> dict:
        """Zeros for the unconditional half unless a negative prompt is given (what training's caption
        dropout gave the UNet, and StableDiffusionXLPipeline's force_zeros_for_empty_prompt); micro-
        conditioning for an uncropped image of the requested size."""
        n = len(prompts)
        context, pooled = self.encode_captions(prompts, device)
        if negative_prompt is None:
            negative, negative_pooled = self.unconditional(n, device)
        else:
            negative, negative_pooled = self.encode_captions([negative_prompt] * n, device)
        time_ids = self.time_ids({}, 2 * n, image_size, device)
        added = {"text_embeds": torch.cat([negative_pooled, pooled]), "time_ids": time_ids}
        return {"encoder_hidden_states": torch.cat([negative, context]), "added_cond_kwargs": added}
