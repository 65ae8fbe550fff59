"""AdamW with its moments stored in a narrower dtype: Megatron-LM's ``--use-precision-aware-optimizer`` with
``--exp-avg-dtype`` / ``--exp-avg-sq-dtype``.

Mixed-precision Adam keeps 16 bytes a parameter beside the bf16 weights: the fp32 master copy and two fp32
moments (12), and the fp32 gradient partition. Stored in bf16 the moments take 4 bytes instead of 8. The
update is AdamW's (``torch.optim.AdamW``'s decoupled decay and bias corrections) computed in the parameter's
dtype, fp32 under DeepSpeed: each step reads a moment into fp32, updates it there, and rounds it back once.
DeepSpeed hands the optimizer one flat fp32 partition per parameter group, so the step walks it in chunks:
the fp32 copies of the moments exist for a chunk at a time, not for the whole partition.

The state keeps AdamW's names (``step``, ``exp_avg``, ``exp_avg_sq``), so DeepSpeed's checkpoints and the
project's conversions read it as they read AdamW's; a loaded state is put back into the stored dtypes (torch's
``load_state_dict`` casts state to the parameter's dtype).
"""
from __future__ import annotations

import math

import torch

_CHUNK = 1 << 24  # elements of one moment's fp32 copy in the step (64 MiB)


class MomentDtypeAdamW(torch.optim.Optimizer):
    """AdamW whose ``exp_avg`` and ``exp_avg_sq`` are stored in ``exp_avg_dtype`` and ``exp_avg_sq_dtype``."""

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 1e-2,
                 exp_avg_dtype: torch.dtype = torch.float32, exp_avg_sq_dtype: torch.dtype = torch.float32):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self.exp_avg_dtype, self.exp_avg_sq_dtype = exp_avg_dtype, exp_avg_sq_dtype

    def _state(self, p: torch.Tensor) -> dict:
        state = self.state[p]
        if not state:
            state["step"] = torch.zeros((), dtype=torch.float32)
            state["exp_avg"] = torch.zeros_like(p, dtype=self.exp_avg_dtype, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, dtype=self.exp_avg_sq_dtype, memory_format=torch.preserve_format)
        return state

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            lr, eps, decay = group["lr"], group["eps"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self._state(p)
                state["step"] += 1
                step = float(state["step"])
                correction1, correction2 = 1.0 - beta1 ** step, 1.0 - beta2 ** step
                p.mul_(1.0 - lr * decay)
                param, grad = p.view(-1), p.grad.reshape(-1)
                exp_avg, exp_avg_sq = state["exp_avg"].view(-1), state["exp_avg_sq"].view(-1)
                for first in range(0, param.numel(), _CHUNK):
                    part = slice(first, first + _CHUNK)
                    g = grad[part].to(p.dtype)
                    m = exp_avg[part].to(p.dtype).lerp_(g, 1.0 - beta1)
                    v = exp_avg_sq[part].to(p.dtype).mul_(beta2).addcmul_(g, g, value=1.0 - beta2)
                    denom = (v.sqrt() / math.sqrt(correction2)).add_(eps)
                    param[part].addcdiv_(m, denom, value=-lr / correction1)
                    exp_avg[part].copy_(m)
                    exp_avg_sq[part].copy_(v)
        return loss

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)
        for state in self.state.values():  # torch cast them to the parameters' dtype
            for key, dtype in (("exp_avg", self.exp_avg_dtype), ("exp_avg_sq", self.exp_avg_sq_dtype)):
                if key in state and state[key].dtype != dtype:
                    state[key] = state[key].to(dtype)
