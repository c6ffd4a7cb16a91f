"""Our Composer extensions: callbacks (NaN guard, resume RNG, evaluation RNG isolation), the
memory-efficient EMA algorithm, sample grids, the pretrained-folder writer and atomic checkpoint
writes. `_target_`s in yamls/ name them; recipes/ builds runs with them."""
