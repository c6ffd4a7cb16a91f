"""Our Composer extensions: callbacks (NaN guard, resume RNG, evaluation RNG isolation, a SpeedMonitor
without a host sync), the memory-efficient EMA algorithm, AdamW with fp32 master weights for bf16
weights, sample grids, the pretrained-folder writer and atomic checkpoint writes. `_target_`s in
yamls/ name them; recipes/ builds runs with them."""

import compat.torchao  # noqa: F401  (first: quiets what importing torchao logs; compat/torchao.py)
