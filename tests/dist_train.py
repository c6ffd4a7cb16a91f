"""Run by tests under `composer -n N`: train, then save this rank's UNet (and EMA) weights.

usage: dist_train.py OUT_DIR YAML [key=value ...]
"""

import logging
import sys
from pathlib import Path

if __name__ == "__main__":
    # Imported here for what train.py says: Composer's spawned upload helpers import this script.
    import torch
    from composer.utils import dist
    from torch.distributed.tensor import DTensor

    from extensions.ema import find_ema
    from recipes import load_config, train

    def whole(state: dict) -> dict:
        """Sharded (FSDP2) tensors gathered whole: a collective, which every rank runs in one order."""
        return {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in state.items()}

    out, yaml_path, *overrides = sys.argv[1:]
    logging.basicConfig(level=logging.INFO)  # as train.py: the run's log lines, which tests read
    trainer = train(load_config(yaml_path, overrides))
    model = getattr(trainer.state.model, "module", trainer.state.model)  # unwrap DDP
    rank = dist.get_global_rank()
    torch.save(whole(model.denoiser.state_dict()), Path(out) / f"unet-rank{rank}.pt")
    ema = find_ema(trainer.state.algorithms)
    if ema is not None:
        torch.save(whole(ema.averaged_state()), Path(out) / f"ema-rank{rank}.pt")
