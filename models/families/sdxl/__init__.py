"""SDXL: a UNet on two CLIP text encoders with micro-conditioning (family "sdxl")."""
