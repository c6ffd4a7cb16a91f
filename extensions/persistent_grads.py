"""Gradients in buffers of their own when the denoiser runs under CUDA graphs.

Composer zeroes gradients with `optimizer.zero_grad(set_to_none=True)` before a batch's first
microbatch. The first backward then finds every `.grad` unset, and autograd's AccumulateGrad keeps
the tensor the backward produced as the gradient. Under CUDA graphs (torch.compile's cudagraph
trees, `model.compile_unet: {mode: reduce-overhead}`) that tensor lives in the graph's memory pool,
which the next microbatch's replay reuses: with gradient accumulation the second microbatch's
AccumulateGrad then adds into memory the replay has overwritten, and the run either fails ("accessing
tensor output of CUDAGraphs that has been overwritten by a subsequent run") or, as reported, trains
on wrong gradients (pytorch/pytorch#96693, #169545; still open in torch 2.7).

`PersistentGradients` gives every trained parameter a gradient buffer of its own before the first
forward of each batch (zeroed with one `torch._foreach_zero_`), so AccumulateGrad adds each
microbatch's gradient into it in place and never keeps the graph's output. The buffers are allocated
once and kept, so memory is what the gradients took already. recipes/trainer.py adds it to runs that
compile the denoiser with CUDA graphs.

One difference from unset gradients: a trained parameter that the batch does not reach gets a zero
gradient instead of none, so AdamW still decays its moments and applies weight decay. Every
parameter of our denoisers is reached in every training forward.
"""

import torch
from composer.core import Callback, State
from composer.loggers import Logger


class PersistentGradients(Callback):
    """Before each microbatch's forward, a trained parameter of `module` without a gradient gets its
    own zeroed buffer (see the module docstring)."""

    def __init__(self, module: torch.nn.Module):
        self.params = [p for p in module.parameters() if p.requires_grad]
        self.buffers: list[torch.Tensor] | None = None

    def before_forward(self, state: State, logger: Logger) -> None:
        if all(p.grad is not None for p in self.params):  # a later microbatch: keep accumulating
            return
        if self.buffers is None or any(b.device != p.device for b, p in zip(self.buffers, self.params)):
            self.buffers = [torch.zeros_like(p, memory_format=torch.preserve_format) for p in self.params]
        else:
            torch._foreach_zero_(self.buffers)
        for p, buffer in zip(self.params, self.buffers, strict=True):
            p.grad = buffer
