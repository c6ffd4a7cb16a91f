"""A rectified-flow MMDiT, SD3-style (Esser et al. 2024, "Scaling Rectified Flow Transformers for
High-Resolution Image Synthesis"): the ComposerModel of the "mmdit" presets
(models/families/mmdit/presets.py).

Built from diffusers' components under their names in a StableDiffusion3Pipeline folder, so that an
export loads there: `transformer` (SD3Transformer2DModel, the part that trains), `vae` (an AutoencoderKL
with a shift as well as a scale), `text_encoder` (CLIP ViT-L/14) and `text_encoder_2` (OpenCLIP
ViT-bigG/14), both CLIPTextModelWithProjection, with `tokenizer` and `tokenizer_2`, optionally
`text_encoder_3` (T5) with `tokenizer_3`, and `noise_scheduler` (FlowMatchEulerDiscreteScheduler, the
sampler). The family-independent parts (the training step's draws, VAE moments, per-sample validation
seeds, caption-dropout draws, metrics, FLOPs per batch) are the shared model's
(models/engine/latent_diffusion.py).

The objective is rectified flow with SD3's logit-normal timesteps, shift and loss weightings
(models/engine/objectives.py, RectifiedFlow; `self.objective`, whose options the attributes of the same names
read and set) on x0 = (a sample of the VAE posterior - latent_shift) * latent_scale. One shift for
training and sampling (`shift_for`): timestep_shift None is the noise scheduler's `shift` (a loaded
SD3's 3.0, the preset's: sd3-medium 3.0, mmdit-tiny 1.0); with "auto" an export's scheduler has one
fixed shift, the model's native size's (sample_size x the VAE's factor), as its README says.

Conditioning is what StableDiffusion3Pipeline.encode_prompt computes from the same encoders: both
CLIPs' penultimate hidden states side by side (768 + 1280 = 2048 wide for SD3), zero-padded to the
transformer's joint_attention_dim (4096), then the T5 part on the sequence axis: T5's embeddings of
`t5_tokens` tokens, or, with T5 off (the default), that many tokens of zeros, as the pipeline makes
them without a `text_encoder_3`. So the pipeline must be called with max_sequence_length=t5_tokens
(77 for sd3-medium): the zero tokens are not nothing, the context embedder turns them into its bias,
which the image attends to. The pooled vector is both CLIPs' projected outputs side by side (2048).

Caption dropout replaces a sample's context and pooled vector by those of the empty caption "": what
the pipeline uses when no negative prompt is given, and what `generate`'s unconditional branch uses,
so guidance pushes away from what training dropped to, and an export samples the same image. (SD3
drops each of its three encoders independently, at 46.4% each, so that T5 can be left off at
inference; with T5 off by default, dropping all together is the plain classifier-free-guidance
dropout.)

Batch keys: `image` (or `latents`: the VAE moments, as `sd-convert latents` stores them), and either
`input_ids` + `input_ids_2` (+ `input_ids_3`, T5's ids, with T5) or the precomputed `text_embeds`
(B, 77, 768 + 1280: the CLIP part, unpadded, as SDXL stores it: a quarter of the padded context) +
`pooled_text_embeds` (B, 2048) (+ `text_embeds_3` (B, t5_tokens, 4096) with T5).

Training draws its latent samples, caption dropout, noise and timesteps from the global RNG (or
keyed per sample with `train_draws: sample`, models/engine/draw_keys.py); validation (`eval_forward`) draws
the latent sample, noise and timestep of each sample from a generator seeded by its content
(LatentDiffusion.eval_seeds), so a checkpoint's validation loss is the same number every time.
"""

import torch
import torch.nn.functional as F

from models.engine.conditioners import CLIPsAndT5
from models.engine.flow_model import FlowTransformer
from models.engine.latent_diffusion import in_dtype
from models.engine.tokenizer import tokenize_t5


class RectifiedFlowTransformer(FlowTransformer):
    """`transformer` trains; the VAE and text encoders are frozen and stay in eval mode.

    Objective options (see the module docstring): timestep_mean, timestep_std (the logit-normal's,
    SD3's 0 and 1), timestep_shift (None: the noise scheduler's shift; a number, 1 = none; or
    "auto": by resolution; training and sampling use the same, `shift_for`), loss_weighting
    (None, "sigma_sqrt", "cosmap"), timestep_density (None: logit-normal; or "uniform"),
    caption_drop_prob (replaces a sample's condition by the empty caption's, which trains the
    unconditional branch classifier-free guidance needs; SD3: 0.1 in effect for the CLIPs together).

    t5_tokens: the length of the T5 part of the context, zeros when there is no `text_encoder_3`.
    `eval_seed` seeds validation's random draws.
    """

    conditioner = CLIPsAndT5()  # both CLIPs and an optional T5 (models/engine/conditioners.py)
    frozen_names = ("vae", "text_encoder", "text_encoder_2", "text_encoder_3")

    def __init__(
        self,
        transformer,
        vae,
        text_encoder,
        tokenizer,
        noise_scheduler,
        *,
        text_encoder_2,
        tokenizer_2,
        latent_scale: float,
        t5_tokens: int,
        latent_shift: float = 0.0,
        text_encoder_3=None,
        tokenizer_3=None,
        caption_drop_prob: float = 0.0,
        **objective,
    ):
        super().__init__(noise_scheduler, caption_drop_prob, **objective)
        if (text_encoder_3 is None) != (tokenizer_3 is None):
            raise ValueError("text_encoder_3 (T5) and tokenizer_3 come together: give both or neither")
        config = transformer.config
        clip_width = text_encoder.config.hidden_size + text_encoder_2.config.hidden_size
        pooled_width = text_encoder.config.projection_dim + text_encoder_2.config.projection_dim
        if clip_width > config.joint_attention_dim or pooled_width != config.pooled_projection_dim:
            raise ValueError(
                f"the text encoders give {clip_width} context and {pooled_width} pooled channels; the "
                f"transformer takes up to {config.joint_attention_dim} and exactly "
                f"{config.pooled_projection_dim}"
            )
        self.set_parts(
            transformer,
            vae,
            dict(text_encoder=text_encoder, text_encoder_2=text_encoder_2, text_encoder_3=text_encoder_3),
            dict(tokenizer=tokenizer, tokenizer_2=tokenizer_2, tokenizer_3=tokenizer_3),
            latent_scale,
            latent_shift,
            t5_tokens,
        )

    # -- conditioning ----------------------------------------------------------------------------
    def encode_clip(
        self, input_ids: torch.Tensor, input_ids_2: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(clip (B, 77, D1 + D2), pooled (B, P1 + P2)): both CLIPs' penultimate hidden states side by
        side, unpadded, and their projected pooled outputs side by side."""
        clip, first, second = self.conditioner.hidden(
            self, {"input_ids": input_ids, "input_ids_2": input_ids_2}
        )
        return clip, torch.cat([first.text_embeds, second.text_embeds], dim=-1)

    @torch.no_grad()
    def encode_t5(self, input_ids_3: torch.Tensor) -> torch.Tensor:
        """T5's last hidden states (B, t5_tokens, D3)."""
        return self.text_encoder_3(input_ids_3)[0]

    def joint_context(self, clip: torch.Tensor, t5: torch.Tensor | None = None) -> torch.Tensor:
        """The transformer's context (B, 77 + t5_tokens, joint_attention_dim): the CLIP part zero-padded
        to the joint width, then T5's part, or zeros without T5 (as the SD3 pipeline assembles it)."""
        width = self.transformer.config.joint_attention_dim
        if t5 is None:
            if self.text_encoder_3 is not None:
                raise ValueError(
                    "this model reads T5 (text_encoder_3): the batch needs input_ids_3 or text_embeds_3"
                )
            t5 = clip.new_zeros(clip.shape[0], self.t5_tokens, width)
        return torch.cat([F.pad(clip, (0, width - clip.shape[-1])), t5.to(clip.dtype)], dim=1)

    def encode_text(self, input_ids, input_ids_2, input_ids_3=None) -> tuple[torch.Tensor, torch.Tensor]:
        """(context, pooled) of token ids, as StableDiffusion3Pipeline.encode_prompt makes them."""
        ids = {"input_ids": input_ids, "input_ids_2": input_ids_2, "input_ids_3": input_ids_3}
        stored = self.conditioner.encode(self, ids)
        return self.joint_context(stored["text_embeds"], stored.get("text_embeds_3")), stored[
            "pooled_text_embeds"
        ]

    def tokenize_t5(self, captions: list[str]) -> torch.Tensor:
        """T5 token ids (B, t5_tokens), as the SD3 pipeline tokenizes with max_sequence_length=t5_tokens
        (and the data loader, data/image_caption.py, for `input_ids_3`)."""
        return tokenize_t5(self.tokenizer_3, captions, self.t5_tokens)

    def encode_captions(self, captions: list[str], device) -> tuple[torch.Tensor, torch.Tensor]:
        ids = {name: value.to(device) for name, value in self.conditioner.ids(self, captions).items()}
        return self.encode_text(**ids)

    def empty_condition(self, device) -> tuple[torch.Tensor, torch.Tensor]:
        """(context (1, L, W), pooled (1, P)) of the empty caption: what a dropped caption becomes and
        the unconditional branch's condition. The encoders are frozen, so it is made once per device,
        from LatentDiffusion.empty_stored (encoded, or the precomputed set's) as a batch's stored
        columns are (`condition`)."""
        device = torch.device(device)
        if device not in self._empty:
            stored = self.empty_stored(device)
            context = self.joint_context(stored["text_embeds"], stored.get("text_embeds_3"))
            self._empty[device] = (context, stored["pooled_text_embeds"])
        return self._empty[device]

    def condition(self, batch, drop_captions: bool, image_size: tuple[int, int] | None = None) -> dict:
        """The transformer's keyword arguments besides the noisy latents and timesteps:
        `encoder_hidden_states` (the joint context) and `pooled_projections`, from token ids or
        precomputed embeddings, with caption dropout when `drop_captions` (training only)."""
        if "text_embeds" in batch:
            t5 = batch.get("text_embeds_3")
            if t5 is not None and self.text_encoder_3 is None:
                raise ValueError(
                    "the batch holds T5's context (text_embeds_3) but this model reads none: convert "
                    "without --t5, or load text_encoder_3 (model.pretrained_components)"
                )
            context = self.joint_context(batch["text_embeds"].float(), None if t5 is None else t5.float())
            pooled = batch["pooled_text_embeds"].float()
        else:
            context, pooled = self.encode_text(
                batch["input_ids"], batch["input_ids_2"], batch.get("input_ids_3")
            )
        if drop_captions:
            context, pooled = self.caption_dropout(
                [context, pooled], lambda: self.empty_condition(context.device)
            )
        return {"encoder_hidden_states": context, "pooled_projections": pooled}

    # -- training --------------------------------------------------------------------------------
    def native_size(self) -> tuple[int, int]:
        """(height, width) in pixels the transformer is sized for: `generate`'s default, the export's."""
        side = self.transformer.config.sample_size * self.vae_scale_factor
        return side, side

    def denoise(self, noisy: torch.Tensor, timesteps: torch.Tensor, condition: dict) -> torch.Tensor:
        return self.transformer(hidden_states=noisy, timestep=timesteps, **condition).sample

    # -- sampling --------------------------------------------------------------------------------
    def prompt_condition(
        self, prompts: list[str], negative_prompt: str | None, image_size=None, device=None
    ) -> dict:
        """The transformer's conditioning for a guided batch: the negative prompt's (or the empty
        caption's, the pipeline's default) for each prompt first, then the prompts'. Each is encoded on
        its own, as StableDiffusion3Pipeline.encode_prompt does."""
        context, pooled = self.encode_captions(list(prompts), device)
        negative, negative_pooled = self.encode_captions([negative_prompt or ""] * len(prompts), device)
        return {
            "encoder_hidden_states": torch.cat([negative, context]),
            "pooled_projections": torch.cat([negative_pooled, pooled]),
        }

    @torch.no_grad()
    def generate(
        self,
        prompts: list[str],
        negative_prompt: str | None = None,
        guidance_scale: float = 5.0,
        num_inference_steps: int = 25,
        height: int | None = None,
        width: int | None = None,
        seed: int = 0,
        sampler: str | None = None,
        seeds: list[int] | None = None,
        guidance_rescale: float | None = None,
    ) -> torch.Tensor:
        """Images for `prompts` as a float tensor (B, 3, H, W) in [0, 1]: Euler steps of the flow from
        noise (`sampling_scheduler`: FlowMatchEulerDiscreteScheduler with the shift training used at
        height x width, `shift_for`) with classifier-free guidance, the steps StableDiffusion3Pipeline
        takes: the pipeline samples the same image when its scheduler has that shift.

        The initial noise comes from a CPU generator seeded with `seed` (or one per prompt with
        `seeds`), so the same seed gives the same image on any device, and the pipeline given
        `generator=torch.Generator().manual_seed(seed)` (a list of them for `seeds`),
        max_sequence_length=t5_tokens and no negative prompt draws the same one. A guidance scale of 1
        or less runs the conditional branch alone, as the pipeline does. `sampler` is "euler" (or None
        for it), the one sampler of a flow; `guidance_rescale` (a DDPM sampler's option) must be 0 or
        None. Height and width must be multiples of the VAE's factor x the patch size.
        """
        factor = self.vae_scale_factor
        multiple = factor * self.transformer.config.patch_size
        height, width = self.sampling_size(sampler, guidance_rescale, height, width, multiple)
        device = next(self.transformer.parameters()).device
        scheduler = self.sampling_scheduler((height, width))
        scheduler.set_timesteps(num_inference_steps, device=device)

        n = len(prompts)
        guided = guidance_scale > 1
        condition = self.prompt_condition(list(prompts), negative_prompt, (height, width), device)
        if not guided:
            condition = {key: value[n:] for key, value in condition.items()}
        shape = (n, self.transformer.config.in_channels, height // factor, width // factor)
        latents = self.initial_noise(shape, seed, seeds).to(device, condition["encoder_hidden_states"].dtype)
        dtype = self.denoiser_dtype
        condition = in_dtype(condition, dtype)

        def velocity(latents, t):
            model_in = torch.cat([latents, latents]) if guided else latents
            velocity = self.transformer(
                hidden_states=model_in.to(dtype), timestep=t.expand(model_in.shape[0]), **condition
            ).sample.float()
            if guided:
                uncond, cond = velocity.chunk(2)
                velocity = uncond + guidance_scale * (cond - uncond)
            return velocity

        return self.to_images(self.euler_steps(scheduler, latents, velocity))
