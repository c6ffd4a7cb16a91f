"""The tiny MMDiT runs the FSDP2 tests share (recipes/parallelism.py): tests.resume_check's command
(tests/dist_train.py, a checkpoint every batch, loss and sample-key logs) on yamls/tiny-mmdit-cpu.yaml,
in the shapes the tests compare. `mmdit_reference(name)` (tests/conftest.py) trains each once per
session; the kill, elastic, S3 and export tests compare against them.
"""

from pathlib import Path

from tests.resume_check import LAUNCH, train_command

RECIPE = "tiny-mmdit-cpu"
# 6 batches of 16 of the 64 shapes: epoch 1 and half of epoch 2 (kills land mid- and across epochs).
BATCHES = 6
# A microbatch cap of 8: one microbatch of a rank's 8 samples on 2 processes, 2 of 8 on one (an
# elastic restart re-derives it), one of 4 on 4.
COMMON = ["trainer.device_train_microbatch_size=8", f"trainer.max_duration={BATCHES}ba"]
SHAPES = {  # name -> (processes, overrides)
    # With every block recomputed in the backward pass: the DDP comparison then covers it too, and the
    # one-process continuation (no checkpointing) loads its checkpoint.
    "shard-2": (2, ["parallelism.shard=2", "model.activation_checkpointing=blocks"]),
    "hsdp-2x2": (4, ["parallelism.shard=2", "parallelism.replicate=2"]),
}


def mmdit_command(
    name: str, out: Path, shapes_mds: Path, *extra: str, nproc=None, save_folder=None, launch=LAUNCH
) -> list[str]:
    """The command of shape `name` (SHAPES; `nproc` another process count, for an elastic restart;
    `launch`: resume_check.train_command's)."""
    processes, overrides = SHAPES[name]
    return train_command(
        nproc or processes,
        out,
        shapes_mds,
        *COMMON,
        *overrides,
        *extra,
        save_folder=save_folder,
        launch=launch,
        recipe=RECIPE,
    )
