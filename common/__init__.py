"""Utilities every layer may use: atomic file writes (`common.atomic`), keeping secrets out of logs
and checkpoints (`common.secrets`), and a launched rank's lifetime (`common.lifetime`). They import
nothing of ours."""
