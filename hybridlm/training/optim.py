"""AdamW with Megatron's weight-decay rule, and the learning-rate schedule.

We build the optimizer ourselves and hand it to ``deepspeed.initialize``: DeepSpeed's
"Adam" from the JSON would JIT-compile FusedAdam (minutes on a CPU machine) where
``torch.optim.AdamW(fused=True)`` is as fast on GPU. Under ZeRO-Offload on a GPU the
update runs on the CPU, where DeepSpeed's vectorised CPU Adam is the fast choice.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist
from deepspeed.moe.utils import is_moe_param, split_params_into_different_moe_groups_for_optimizer
from torch import nn

from ..config import TrainConfig


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Norm weights and biases (1-D tensors) get no weight decay. Named, as DeepSpeed's MoE
    helper needs to split expert parameters into groups of their own."""
    decay, no_decay = [], []
    for param in model.parameters():
        if param.requires_grad:
            (no_decay if param.ndim < 2 else decay).append(param)
    return [{"name": "decay", "params": decay, "weight_decay": weight_decay},
            {"name": "no_decay", "params": no_decay, "weight_decay": 0.0}]


def global_grad_norm(model: nn.Module, ps) -> torch.Tensor:
    """L2 norm of all gradients of the whole model, identical on every rank.

    Each gradient is counted once: a TP-replicated one only on TP rank 0, a tied weight only
    on the stage that owns it (DeepSpeed marks the copies ``ds_pipe_replicated``), an
    expert's on the EP rank that holds it (summed over the EP group); the sum of squares
    then goes over the TP x PP group (DP replicas hold equal gradients).
    """
    device = next(model.parameters()).device
    total = torch.zeros((), device=device, dtype=torch.float32)
    experts = torch.zeros((), device=device, dtype=torch.float32)
    for p in model.parameters():
        if p.grad is None or getattr(p, "ds_pipe_replicated", False):
            continue
        if is_moe_param(p):
            experts += p.grad.detach().float().pow(2).sum()
            continue
        if ps.tp.rank != 0 and not getattr(p, "tensor_model_parallel", False):
            continue
        total += p.grad.detach().float().pow(2).sum()
    if ps.ep.size > 1:
        dist.all_reduce(experts, group=ps.ep.group)
    total += experts
    if ps.get_model_parallel_world_size() > 1:
        dist.all_reduce(total, group=ps.get_model_parallel_group())
    return total.sqrt()


class ClippingAdamW(torch.optim.AdamW):
    """AdamW that computes the global gradient norm and clips before stepping.

    Used where DeepSpeed applies the client optimizer directly (fp32 without ZeRO): there
    its own clipping counts only pipeline stage 0's gradients under PP, and it reports no
    norm. ZeRO and the bf16/fp16 optimizers compute both correctly and do not need this.
    """

    def __init__(self, groups, *, model: nn.Module, ps, clip: float, **kwargs):
        # Its state dict is the checkpoint's optimizer state: naming the parameters (torch keeps
        # "param_names" per group) lets a checkpoint be read, and reshaped, without this process.
        names = {p: n for n, p in model.named_parameters()}
        groups = [{**g, "param_names": [names[p] for p in g["params"]]} for g in groups]
        super().__init__(groups, **kwargs)
        self._model, self._ps, self._clip = model, ps, clip
        self._global_grad_norm = None  # DeepSpeed reads these two attributes after step()
        self.overflow = False

    @torch.no_grad()
    def step(self, closure=None):
        norm = global_grad_norm(self._model, self._ps)
        self._global_grad_norm = norm
        self.overflow = not bool(torch.isfinite(norm))
        if self.overflow:  # a non-finite step is skipped, as ZeRO's optimizers do
            return None
        if self._clip > 0:
            scale = torch.clamp(self._clip / (norm + 1e-6), max=1.0)
            for p in self._model.parameters():
                if p.grad is not None:
                    p.grad.mul_(scale)
        return super().step(closure)


def build_optimizer(model: nn.Module, cfg: TrainConfig, ps, *, zero_stage: int, offloading: bool, on_gpu: bool):
    """Returns (optimizer, whether it clips by itself so DeepSpeed must not)."""
    groups = param_groups(model, cfg.weight_decay)
    if any(is_moe_param(p) for p in model.parameters()):
        groups = split_params_into_different_moe_groups_for_optimizer(groups)  # ZeRO shards these over expert-DP
    kwargs = dict(lr=cfg.lr, betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_eps)
    impl = cfg.optimizer_impl
    if impl == "auto":
        impl = "deepspeed_cpu" if offloading and on_gpu else "torch"
    if impl == "deepspeed_cpu":
        from deepspeed.ops.adam import DeepSpeedCPUAdam
        return DeepSpeedCPUAdam(groups, adamw_mode=True, **kwargs), False
    fused = on_gpu and not offloading
    if zero_stage == 0 and not (cfg.bf16 or cfg.fp16):
        return ClippingAdamW(groups, model=model, ps=ps, clip=cfg.clip_grad, fused=fused, **kwargs), True
    return torch.optim.AdamW(groups, fused=fused, **kwargs), False


class WarmupDecayLR:
    """Linear warm-up to ``lr`` over ``warmup`` steps, then decay to ``min_lr`` at ``decay_iters``:
    cosine, linear, constant, or WSD (warmup-stable-decay: ``lr`` until the last
    ``wsd_decay_iters`` steps before ``decay_iters``, then a ``wsd_style`` decay).

    Step ``i`` (0-based) trains with ``lr_at(i)``. DeepSpeed calls ``step()`` after every
    applied optimizer step (not after a skipped one) and checkpoints ``state_dict()``."""

    def __init__(self, optimizer, *, lr: float, min_lr: float, warmup: int, decay_iters: int, style: str,
                 wsd_decay_iters: int | None = None, wsd_style: str = "linear"):
        self.optimizer = optimizer
        self.lr, self.min_lr, self.warmup, self.decay_iters, self.style = lr, min_lr, warmup, decay_iters, style
        self.wsd_decay_iters, self.wsd_style = wsd_decay_iters, wsd_style
        self.last_step = 0
        self._apply()

    @classmethod
    def from_config(cls, optimizer, t) -> "WarmupDecayLR":
        return cls(optimizer, lr=t.lr, min_lr=t.min_lr, warmup=t.lr_warmup_iters, decay_iters=t.lr_decay_iters,
                   style=t.lr_decay_style, wsd_decay_iters=t.lr_wsd_decay_iters, wsd_style=t.lr_wsd_decay_style)

    def lr_at(self, step: int) -> float:
        if step < self.warmup:
            return self.lr * (step + 1) / self.warmup
        if self.style == "constant":
            return self.lr
        if self.style == "wsd":
            decay_start = self.decay_iters - self.wsd_decay_iters
            if step < decay_start:
                return self.lr
            progress = min((step - decay_start) / self.wsd_decay_iters, 1.0)
            shape = self.wsd_style
        else:
            progress = min(max(step - self.warmup, 0) / max(self.decay_iters - self.warmup, 1), 1.0)
            shape = self.style
        if shape == "exponential":
            return self.lr * (self.min_lr / self.lr) ** progress
        factor = {"linear": 1.0 - progress, "cosine": 0.5 * (1.0 + math.cos(math.pi * progress)),
                  "minus_sqrt": 1.0 - math.sqrt(progress)}[shape]
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
