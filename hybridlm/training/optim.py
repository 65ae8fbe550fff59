"""AdamW with Megatron's weight-decay rule, and the learning-rate schedule.

We build the optimizer ourselves and hand it to ``deepspeed.initialize``: DeepSpeed's
"Adam" from the JSON would JIT-compile FusedAdam (minutes on a CPU machine) where
``torch.optim.AdamW(fused=True)`` is as fast on GPU. Under ZeRO-Offload on a GPU the
update runs on the CPU, where DeepSpeed's vectorised CPU Adam is the fast choice.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from ..config import TrainConfig


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Norm weights and biases (1-D tensors) get no weight decay."""
    decay, no_decay = [], []
    for param in model.parameters():
        if param.requires_grad:
            (no_decay if param.ndim < 2 else decay).append(param)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def build_optimizer(model: nn.Module, cfg: TrainConfig, *, offloading: bool, on_gpu: bool):
    groups = param_groups(model, cfg.weight_decay)
    kwargs = dict(lr=cfg.lr, betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_eps)
    impl = cfg.optimizer_impl
    if impl == "auto":
        impl = "deepspeed_cpu" if offloading and on_gpu else "torch"
    if impl == "deepspeed_cpu":
        from deepspeed.ops.adam import DeepSpeedCPUAdam
        return DeepSpeedCPUAdam(groups, adamw_mode=True, **kwargs)
    return torch.optim.AdamW(groups, fused=on_gpu and not offloading, **kwargs)


class WarmupDecayLR:
    """Linear warm-up to ``lr`` over ``warmup`` steps, then cosine/linear/constant decay to
    ``min_lr`` at ``decay_iters``. Step ``i`` (0-based) trains with ``lr_at(i)``; DeepSpeed
    calls ``step()`` after every applied optimizer step and checkpoints ``state_dict()``."""

    def __init__(self, optimizer, *, lr: float, min_lr: float, warmup: int, decay_iters: int, style: str):
        self.optimizer = optimizer
        self.lr, self.min_lr, self.warmup, self.decay_iters, self.style = lr, min_lr, warmup, decay_iters, style
        self.last_step = 0
        self._apply()

    def lr_at(self, step: int) -> float:
        if step < self.warmup:
            return self.lr * (step + 1) / self.warmup
        if self.style == "constant":
            return self.lr
        span = max(self.decay_iters - self.warmup, 1)
        progress = min(max(step - self.warmup, 0) / span, 1.0)
        if self.style == "linear":
            factor = 1.0 - progress
        else:
            factor = 0.5 * (1.0 + math.cos(math.pi * progress))
        return self.min_lr + (self.lr - self.min_lr) * factor

    def _apply(self) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = self.lr_at(self.last_step)

    def step(self, *args, **kwargs) -> None:
        self.last_step += 1
        self._apply()

    def get_last_lr(self) -> list[float]:
        return [self.lr_at(self.last_step)]

    def state_dict(self) -> dict:
        return {"last_step": self.last_step}

    def load_state_dict(self, state: dict) -> None:
        self.last_step = state["last_step"]
        self._apply()
