"""Stable Diffusion 1.5 / 2: a UNet on one CLIP text encoder (family "sd")."""
