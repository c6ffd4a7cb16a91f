"""One training batch's loss of flux-tiny against the MLPerf Flux.1 reference's formulas, written here
from the reference's code and not by calling ours (mlcommons/training text_to_image, its torchtitan
submodule at 9603aa83: torchtitan/experiments/flux/train.py `train_step`, model/autoencoder_utils.py
`generate_unscaled_latent_from_mean_logvar`, utils.py `pack_latents`, `unpack_latents`,
`create_position_encoding_for_latents`, loss.py `mse_loss`, model/hf_embedder.py).

The draws are shared: the posterior's eps and the noise come from the global RNG in the reference's
order (seeded alike on both sides); the reference's `timesteps = torch.rand(bsz)` is replaced by the
noise levels our model drew (uniform too, as the inverse normal CDF of a normal draw), which it
returns. The transformer is the same module on both sides: what is compared is everything around it.
"""

import torch
import torch.nn.functional as F

from models import build_model

PROMPTS = ["a red circle", "a blue square", "a green triangle"]
SEED = 7


def reference_pack(x: torch.Tensor) -> torch.Tensor:
    """utils.py pack_latents: "b c (h ph) (w pw) -> b (h w) (c ph pw)" through unfold."""
    b, c, height, width = x.shape
    x = x.unfold(2, 2, 2).unfold(3, 2, 2)  # [b, c, h, w, ph, pw]
    return x.permute(0, 2, 3, 1, 4, 5).reshape(b, (height // 2) * (width // 2), c * 4)


def reference_unpack(x: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """utils.py unpack_latents: "b (h w) (c ph pw) -> b c (h ph) (w pw)"."""
    b, _, channels = x.shape
    x = x.reshape(b, height // 2, width // 2, channels // 4, 2, 2)  # [b, h, w, c, ph, pw]
    return x.permute(0, 3, 1, 4, 2, 5).reshape(b, channels // 4, height, width)


def reference_positions(height: int, width: int) -> torch.Tensor:
    """utils.py create_position_encoding_for_latents (one sample's): (row, column) in dims 1 and 2."""
    ids = torch.zeros(height // 2, width // 2, 3)
    ids[..., 1] = torch.arange(height // 2)[:, None]
    ids[..., 2] = torch.arange(width // 2)[None, :]
    return ids.reshape(-1, 3)


def test_one_batch_loss_equals_the_reference_formulas_on_the_same_draws():
    torch.manual_seed(0)
    model = build_model("flux-tiny", caption_drop_prob=0.0).train()  # dropout draws nothing at 0
    channels = model.vae.config.latent_channels
    mean = torch.randn(len(PROMPTS), channels, 8, 8)
    logvar = torch.rand(len(PROMPTS), channels, 8, 8) * 2 - 3  # std 0.22 .. 0.61
    batch = {"latents": torch.cat([mean, logvar], dim=1), **model.conditioner.ids(model, PROMPTS)}

    torch.manual_seed(SEED)
    prediction, target, t = model(batch)
    ours = model.loss((prediction, target, t), batch).item()

    torch.manual_seed(SEED)
    with torch.no_grad():
        # train_step, the stored-latents branch: sample, then (z - shift) * scale
        eps = torch.randn_like(mean)
        z = mean + torch.exp(0.5 * logvar) * eps
        labels = model.vae.config.scaling_factor * (z - model.vae.config.shift_factor)
        clip = model.text_encoder(batch["input_ids"]).pooler_output  # hf_embedder: pooler_output
        t5 = model.text_encoder_2(batch["input_ids_3"]).last_hidden_state  # and last_hidden_state
        noise = torch.randn_like(labels)
        sigmas = t.view(-1, 1, 1, 1)
        latents = (1 - sigmas) * labels + sigmas * noise
        height, width = latents.shape[-2:]
        packed = reference_pack(latents)
        output = model.transformer(
            hidden_states=packed,
            encoder_hidden_states=t5,
            pooled_projections=clip,
            timestep=t,  # t in (0, 1): both models multiply by 1000 inside
            img_ids=reference_positions(height, width),
            txt_ids=torch.zeros(t5.shape[1], 3),
            return_dict=False,
        )[0]
        pred = reference_unpack(output, height, width)
        reference = F.mse_loss(pred.float(), (noise - labels).float()).item()

    assert ((t > 0) & (t < 1)).all() and len(set(t.tolist())) == len(PROMPTS)
    assert abs(ours - reference) <= 1e-6 * max(1.0, abs(reference)), (ours, reference)
    torch.testing.assert_close(target, noise - labels, rtol=0, atol=1e-6)
