"""AdamW over low-precision (bf16) model weights, with fp32 master weights in the optimizer state.

`model.param_dtype: bfloat16` (models/build.py) keeps the denoiser's weights in bf16, so the forward
and backward read them as they are: no autocast cast of every fp32 weight on every use of every
microbatch (issue 29: ~1,556 casts a step, 16% of an H100's time at 256 px). Updating bf16 weights
directly would lose every update smaller than half a bf16 step of the weight (2^-9 of it: most of
them, at a learning rate of 1e-4), so the optimizer keeps the fp32 copy:

- The model's parameters stay its own `nn.Parameter`s, in bf16: checkpoints, DDP, gradient clipping,
  EMA and parameter names see the model as usual. Each one's optimizer state holds its fp32
  `master` beside AdamW's fp32 `exp_avg` and `exp_avg_sq` (`master_of` finds it); fp32 parameters
  (if any) are stepped directly, as torch's AdamW does. An fp32 EMA (extensions/ema.py) averages
  the masters, not the rounded weights, in one fused update.
- A step copies the bf16 gradients to fp32 (one transient fp32 copy of them), runs torch's own AdamW
  (`torch.optim.adamw.adamw`: the fused, foreach or single-tensor kernel that `fused`/`foreach`
  pick, exactly as torch.optim.AdamW would over fp32 weights) on the masters, then writes each
  master back into its bf16 parameter, rounded to nearest. Given the same fp32 gradients, the
  masters are bitwise those of torch.optim.AdamW over fp32 weights (tests/test_master_weights.py).
- `load_state_dict` keeps the masters and moments fp32 (torch's would cast every floating state
  tensor to its parameter's dtype, rounding them to bf16), so a resumed run continues bitwise.

Gradients are bf16: the backward writes them in the weights' dtype, and across microbatches they
accumulate in bf16 (DDP all-reduces bf16 buckets: half the traffic). Each microbatch's gradient is
as precise as under autocast with fp32 weights (a bf16 matmul's weight gradient, there cast up
afterwards); each accumulating add rounds the running sum to bf16, a relative error of at most 2^-8
(~0.4%) per add, so k microbatches add up to ~k * 2^-8 in the worst case and about sqrt(k) * 2^-9
typically. With one microbatch a step nothing accumulates. Memory per trained parameter: 2 bytes of
weight, 2 of gradient, 12 of master and moments (16 as with fp32 weights), plus the 4-byte fp32
gradient copy while the optimizer steps.
"""

import torch
from torch.optim.adamw import adamw

LOW_PRECISION = (torch.bfloat16, torch.float16)
# The fp32 state of a low-precision parameter: what load_state_dict must not round to its dtype.
FP32_STATE = ("master", "exp_avg", "exp_avg_sq", "max_exp_avg_sq")


def needs_masters(params) -> bool:
    """Whether any of `params` is low precision: an optimizer over them must keep fp32 masters."""
    return any(p.dtype in LOW_PRECISION for p in params)


def master_of(optimizer: torch.optim.Optimizer, p: torch.Tensor) -> torch.Tensor | None:
    """The fp32 master of parameter `p` that `optimizer` keeps, or None: not a MasterWeightAdamW, an
    fp32 parameter, or none yet (a master is made at the parameter's first step, or by a load).
    The master is updated in place by each step and replaced by `load_state_dict`."""
    if not isinstance(optimizer, MasterWeightAdamW):
        return None
    state = optimizer.state.get(p)  # .get: the state is a defaultdict, and this must not add to it
    return None if state is None else state.get("master")


class MasterWeightAdamW(torch.optim.AdamW):
    """torch.optim.AdamW (same arguments, same update) that keeps an fp32 master copy of each
    low-precision parameter in its state and steps that; see the module docstring."""

    def __init__(self, params, *args, **kwargs):
        super().__init__(params, *args, **kwargs)
        if any(group["differentiable"] for group in self.param_groups):
            raise ValueError("MasterWeightAdamW: differentiable=True is not supported")

    def _init_state(self, p: torch.Tensor, group: dict) -> dict:
        """torch's AdamW state (`step` where its Adam puts it: on the parameter's device when fused or
        capturable, else on the CPU), in fp32, and the fp32 master of a low-precision parameter."""
        state = self.state[p]
        on_device = group["fused"] or group["capturable"]
        default64 = torch.get_default_dtype() == torch.float64
        dtype = torch.float64 if default64 and not group["fused"] else torch.float32
        state["step"] = torch.zeros((), dtype=dtype, device=p.device if on_device else "cpu")
        if p.dtype in LOW_PRECISION:
            # preserve_format: a channels-last weight gets a channels-last master and moments.
            state["master"] = p.detach().to(torch.float32, memory_format=torch.preserve_format, copy=True)
        weights = state.get("master", p)
        state["exp_avg"] = torch.zeros_like(weights, memory_format=torch.preserve_format)
        state["exp_avg_sq"] = torch.zeros_like(weights, memory_format=torch.preserve_format)
        if group["amsgrad"]:
            state["max_exp_avg_sq"] = torch.zeros_like(weights, memory_format=torch.preserve_format)
        return state

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            weights, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps = [], [], [], [], [], []
            low, masters = [], []  # the low-precision parameters with a gradient, and their masters
            low_grads, fp32_grads = [], []  # their gradients, and fp32 copies for the update
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("MasterWeightAdamW does not support sparse gradients")
                state = self.state[p] or self._init_state(p, group)
                if "master" in state:
                    low.append(p)
                    masters.append(state["master"])
                    weights.append(state["master"])
                    low_grads.append(p.grad)
                    fp32_grads.append(torch.empty_like(p.grad, dtype=torch.float32))
                    grads.append(fp32_grads[-1])
                else:
                    weights.append(p)
                    grads.append(p.grad)
                exp_avgs.append(state["exp_avg"])
                exp_avg_sqs.append(state["exp_avg_sq"])
                if group["amsgrad"]:
                    max_exp_avg_sqs.append(state["max_exp_avg_sq"])
                steps.append(state["step"])
            if not weights:
                continue
            if low:  # exact; on CUDA a few multi-tensor kernels rather than one cast per parameter
                torch._foreach_copy_(fp32_grads, low_grads)
            beta1, beta2 = group["betas"]
            adamw(
                weights,
                grads,
                exp_avgs,
                exp_avg_sqs,
                max_exp_avg_sqs,
                steps,
                foreach=group["foreach"],
                capturable=group["capturable"],
                differentiable=False,
                fused=group["fused"],
                # Set by a GradScaler for a fused optimizer (as torch's Adam.step reads them): the
                # fused kernel unscales the fp32 gradient copies and skips the step on an inf.
                grad_scale=getattr(self, "grad_scale", None),
                found_inf=getattr(self, "found_inf", None),
                has_complex=False,
                amsgrad=group["amsgrad"],
                beta1=beta1,
                beta2=beta2,
                lr=group["lr"],
                weight_decay=group["weight_decay"],
                eps=group["eps"],
                maximize=group["maximize"],
            )
            if low:
                torch._foreach_copy_(low, masters)  # fp32 -> bf16, round to nearest even
        return loss

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's, except that a low-precision parameter's fp32 state (master, moments) stays fp32
        instead of being cast to the parameter's dtype. A state without masters (torch.optim.AdamW's
        over fp32 weights) gets them from the parameters."""
        saved_ids = [i for group in state_dict["param_groups"] for i in group["params"]]
        params = [p for group in self.param_groups for p in group["params"]]
        kept = {}  # saved id -> its fp32 tensors, put back after torch's load
        state = dict(state_dict["state"])
        for i, p in zip(saved_ids, params):
            if p.dtype in LOW_PRECISION and i in state:
                kept[i] = {key: value for key, value in state[i].items() if key in FP32_STATE}
                state[i] = {key: value for key, value in state[i].items() if key not in FP32_STATE}
        super().load_state_dict({**state_dict, "state": state})
        for i, p in zip(saved_ids, params):
            for key, value in kept.get(i, {}).items():
                self.state[p][key] = value.to(device=p.device, dtype=torch.float32)
            if i in kept and "master" not in kept[i]:
                self.state[p]["master"] = p.detach().to(torch.float32, memory_format=torch.preserve_format)
