"""Utilities every layer may use: atomic file writes (`common.atomic`) and keeping secrets out of
logs and checkpoints (`common.secrets`). They import nothing of ours."""
