"""The engine every family is made of: the latent-diffusion model (`LatentDiffusion`, its training
step and validation), the objectives (DDPM, rectified flow), the flow transformer base, the text
conditioners and tokenizers, the training draws, the validation timesteps, and what a `Family` is."""
