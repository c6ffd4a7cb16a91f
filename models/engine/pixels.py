"""Training images as the models take them: float in [-1, 1], or uint8 in [0, 255] as the data loader
hands them over (data/transforms.py), converted here on the device."""

import torch


def to_float(image: torch.Tensor) -> torch.Tensor:
    """uint8 [0, 255] -> float32 [-1, 1] with torchvision's arithmetic (ToTensor's x / 255, then
    Normalize(0.5, 0.5)'s (x - 0.5) / 0.5), so the values are bit-identical to theirs; a float
    tensor is returned unchanged."""
    if image.dtype != torch.uint8:
        return image
    return image.float().div_(255).sub_(0.5).div_(0.5)
