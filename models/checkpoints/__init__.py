"""Checkpoints on disk: one-file checkpoints and their checks, sharded (torch distributed checkpoint)
folders, and the model record a checkpoint carries to rebuild its model."""
