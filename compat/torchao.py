"""torchao as installed beside torch 2.14.1 and diffusers 0.42.1, written for torchao 0.18.0.

transformers (its quantizers) and diffusers (`quantizers.torchao`) import torchao whenever it is
installed, so every process that builds a model imports it, `model.fp8` or not, and that import logs
two things that tell a user nothing:
- torch 2.14 warns, once per Enum that torchao 0.18 registers as a pytree constant (KernelPreference,
  ScaleCalculationMode), that Enums no longer need registering (logger `torch.utils._pytree`);
- diffusers 0.42.1 looks for torchao's NF4Tensor and uintx layouts where torchao 0.15 kept them
  (`torchao.dtypes`), warns "Unable to import `torchao` Tensor objects" and goes on: only reading
  torchao-quantized checkpoints needs them, which we neither write nor read.
`quiet_import()` drops exactly those records, matched by their text; anything else those loggers say
passes. Importing this module runs it, which must come before the first import of transformers or
diffusers (models/__init__.py imports it first).
No private name of torchao is used: models/training/fp8.py trains with its public `torchao.float8`, and
models/training/base_weights.py stores a LoRA run's frozen base with `torchao.quantization`'s
`quantize_`, `Float8WeightOnlyConfig` and `to_nf4` (NF4Tensor lives there in 0.18, not in `torchao.dtypes`).
"""

import logging

# logger name -> the start of the message dropped
KNOWN = {
    "torch.utils._pytree": "<enum ",
    "diffusers.quantizers.torchao.torchao_quantizer": "Unable to import `torchao` Tensor objects",
}
ENUM_NOTE = "is an Enum subclass and is now natively supported"


class _Known(logging.Filter):
    def __init__(self, start: str):
        super().__init__()
        self.start = start

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        known = message.startswith(self.start) and (self.start != "<enum " or ENUM_NOTE in message)
        return not known


def quiet_import() -> None:
    """Install the filters (once per logger, however often called)."""
    for name, start in KNOWN.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, _Known) for f in logger.filters):
            logger.addFilter(_Known(start))


quiet_import()
