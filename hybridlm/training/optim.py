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

from ..config import ConfigError, TrainConfig
from ..parallel.quantized import DTYPES
from .moment_adamw import MomentDtypeAdamW


def param_groups(model: nn.Module, weight_decay: float, decoupled_lr: float | None = None,
                 decoupled_min_lr: float | None = None) -> list[dict]:
    """Norm weights and biases (1-D tensors) get no weight decay. With ``decoupled_lr`` the input
    embedding and the output layer (the parameters holding vocabulary rows) get a group of
    their own whose ``max_lr``/``min_lr`` the schedule follows (Megatron-LM's
    ``is_embedding_or_output_parameter`` override, megatron/core/optimizer/__init__.py).
    Named, as DeepSpeed's MoE helper needs to split expert parameters into groups of their own."""
    decay, no_decay, decoupled = [], [], []
    for param in model.parameters():
        if not param.requires_grad:
            continue
        if decoupled_lr is not None and hasattr(param, "vocab_rows"):
            decoupled.append(param)
        else:
            (no_decay if param.ndim < 2 else decay).append(param)
    groups = [{"name": "decay", "params": decay, "weight_decay": weight_decay},
              {"name": "no_decay", "params": no_decay, "weight_decay": 0.0}]
    if decoupled:
        override = {"max_lr": decoupled_lr, **({"min_lr": decoupled_min_lr} if decoupled_min_lr is not None else {})}
        groups.append({"name": "decoupled_lr", "params": decoupled, "weight_decay": weight_decay, **override})
    return groups


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


def check_optimizer_choice(cfg: TrainConfig, ds: dict, offloaded: list[str]) -> None:
    """--use-precision-aware-optimizer needs the optimizer built here: not one the JSON names or DeepSpeed's CPU Adam."""
    if cfg.use_precision_aware_optimizer and cfg.optimizer_impl == "deepspeed_cpu":
        raise ConfigError("--use-precision-aware-optimizer cannot be combined with --optimizer-impl deepspeed_cpu: "
                          "DeepSpeed's CPU Adam keeps fp32 moments.")
    if cfg.use_precision_aware_optimizer and ("optimizer" in offloaded or "optimizer" in ds):
        why = "offloads the optimizer to DeepSpeed's CPU Adam" if "optimizer" in offloaded else "names its own optimizer"
        raise ConfigError(f"--use-precision-aware-optimizer needs hybridlm's AdamW, and {cfg.deepspeed_config} {why}.")


def build_optimizer(model: nn.Module, cfg: TrainConfig, ps, *, zero_stage: int, offloading: bool, on_gpu: bool):
    """Returns (optimizer, whether it clips by itself so DeepSpeed must not)."""
    groups = param_groups(model, cfg.weight_decay, cfg.decoupled_lr, cfg.decoupled_min_lr)
    if any(is_moe_param(p) for p in model.parameters()):
        groups = split_params_into_different_moe_groups_for_optimizer(groups)  # ZeRO shards these over expert-DP
    # lr 0 until the schedule sets each group's rate (WarmupDecayLR, built after the optimizer): a step DeepSpeed takes
    # while it wraps the optimizer moves nothing (``drop_startup_step``)
    kwargs = dict(lr=0.0, betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_eps)
    impl = cfg.optimizer_impl
    if impl == "auto":
        impl = "deepspeed_cpu" if offloading and on_gpu else "torch"
    if impl == "deepspeed_cpu":
        from deepspeed.ops.adam import DeepSpeedCPUAdam
        return DeepSpeedCPUAdam(groups, adamw_mode=True, **kwargs), False
    fused = on_gpu and not offloading
    if cfg.use_precision_aware_optimizer:
        return MomentDtypeAdamW(groups, exp_avg_dtype=DTYPES[cfg.exp_avg_dtype], exp_avg_sq_dtype=DTYPES[cfg.exp_avg_sq_dtype],
                                **kwargs), False
    if zero_stage == 0 and not (cfg.bf16 or cfg.fp16):
        return ClippingAdamW(groups, model=model, ps=ps, clip=cfg.clip_grad, fused=fused, **kwargs), True
    return torch.optim.AdamW(groups, fused=fused, **kwargs), False


def drop_startup_step(engine) -> None:
    """DeepSpeed's ZeRO-0 half-precision optimizers (FP16_Optimizer, FP16_UnfusedOptimizer: fp16, or bf16 at PP=1)
    call the client optimizer's step once with zero gradients as they wrap it, to create its state. For AdamW that
    step counts: every later bias correction was one step late (the first update 0.73 x the learning rate at betas
    0.9/0.95, converging over ~1/(1 - beta2) steps), and the weight decay of that step, at the constructor's rate,
    reached the master weights. Built with rate 0 (``build_optimizer``), the step moved nothing; its state is dropped
    here, so that AdamW's first step is step 1, as under ZeRO-1/2/3 and in Megatron-LM."""
    from deepspeed.runtime.fp16.fused_optimizer import FP16_Optimizer
    from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer
    if isinstance(engine.optimizer, (FP16_Optimizer, FP16_UnfusedOptimizer)):
        engine.optimizer.optimizer.state.clear()


class WarmupDecayLR:
    """Megatron-LM's learning-rate schedule (``OptimizerParamScheduler.get_lr`` in
    megatron/core/optimizer_param_scheduler.py), counted in samples as Megatron counts it.

    The schedule's clock ``num_steps`` advances by the global batch size after every applied
    optimizer step (DeepSpeed calls ``step()`` only then), so step ``i`` (0-based) trains with the
    rate at ``i x increment`` samples. Warm-up rises linearly from ``init_lr`` (``--lr-warmup-init``,
    default 0: the first step of a warm-up trains at 0) and reaches ``lr`` at ``num_steps ==
    warmup_steps``; then cosine, linear, inverse-square-root, constant, or WSD (``lr`` until
    ``wsd_decay_steps`` before ``decay_steps``, then a ``wsd_style`` decay) down to ``min_lr``,
    which holds after ``decay_steps``. A parameter group's own ``max_lr``/``min_lr`` (the
    embedding and output layer under ``--decoupled-lr``) follow the same clock."""

    def __init__(self, optimizer, *, lr: float, min_lr: float, warmup_steps: float, decay_steps: float, style: str,
                 init_lr: float = 0.0, wsd_decay_steps: float | None = None, wsd_style: str = "exponential", increment: int = 1):
        self.optimizer = optimizer
        self.lr, self.min_lr, self.init_lr, self.style = lr, min_lr, init_lr, "WSD" if style == "wsd" else style
        self.warmup_steps, self.decay_steps, self.wsd_decay_steps, self.wsd_style = warmup_steps, decay_steps, wsd_decay_steps, wsd_style
        self.increment = increment
        self.num_steps = 0
        self._apply()

    @classmethod
    def from_config(cls, optimizer, t) -> "WarmupDecayLR":
        """training.py ``get_optimizer_param_scheduler``: the lengths in samples (``TrainConfig.schedule_in_samples``)."""
        warmup, decay, wsd = t.schedule_in_samples()
        return cls(optimizer, lr=t.lr, min_lr=t.min_lr, init_lr=t.lr_warmup_init, warmup_steps=warmup, decay_steps=decay,
                   style=t.lr_decay_style, wsd_decay_steps=wsd, wsd_style=t.lr_wsd_decay_style, increment=t.global_batch_size)

    def rate(self, num_steps: float, max_lr: float | None = None, min_lr: float | None = None) -> float:
        """The rate after ``num_steps`` samples (Megatron's ``get_lr``, line by line)."""
        max_lr = self.lr if max_lr is None else max_lr
        min_lr = self.min_lr if min_lr is None else min_lr
        if self.warmup_steps > 0 and num_steps <= self.warmup_steps:
            return self.init_lr + (max_lr - self.init_lr) * float(num_steps) / float(self.warmup_steps)
        if self.style == "constant":
            return max_lr
        if num_steps > self.decay_steps:
            return min_lr
        if self.style == "inverse-square-root":
            return max(min_lr, max_lr * max(self.warmup_steps, 1) ** 0.5 / max(num_steps, 1) ** 0.5)
        decay_ratio = float(num_steps - self.warmup_steps) / float(self.decay_steps - self.warmup_steps)
        if self.style == "linear":
            coeff = 1.0 - decay_ratio
        elif self.style == "cosine":
            coeff = 0.5 * (math.cos(math.pi * decay_ratio) + 1.0)
        else:  # WSD
            anneal_start = self.decay_steps - self.wsd_decay_steps
            if num_steps <= anneal_start:
                coeff = 1.0
            else:
                ratio = float(num_steps - anneal_start) / float(self.wsd_decay_steps)
                coeff = {"linear": lambda r: 1.0 - r, "cosine": lambda r: 0.5 * (math.cos(math.pi * r) + 1.0),
                         "exponential": lambda r: 2.0 * math.pow(0.5, r) - 1.0,
                         "minus_sqrt": lambda r: 1.0 - math.sqrt(r)}[self.wsd_style](ratio)
        return min_lr + coeff * (max_lr - min_lr)

    def lr_at(self, step: int) -> float:
        """The rate step ``step`` (0-based) trains with."""
        return self.rate(step * self.increment)

    def _apply(self) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = self.rate(self.num_steps, group.get("max_lr"), group.get("min_lr"))

    def step(self, *args, **kwargs) -> None:
        self.num_steps += self.increment
        self._apply()

    def get_last_lr(self) -> list[float]:
        return [group["lr"] for group in self.optimizer.param_groups]

    def state_dict(self) -> dict:
        return {"num_steps": self.num_steps, "last_step": self.num_steps // max(self.increment, 1)}

    def continue_at(self, iteration: int, skipped: int = 0) -> str | None:
        """After a resume: put the clock at ``iteration`` of this run's schedule (less the ``skipped`` steps, which
        never moved it) and set that rate now. A checkpoint's clock counts the samples of the run that saved it, and
        the optimizer state loaded after it restores that run's rate; with another --train-iters or
        --global-batch-size either would train at the old schedule's rate (or past the new one's end, at LR 0).
        Returns a line for the log when that moved the rate or the clock."""
        saved_samples, saved_lr = self.num_steps, self.optimizer.param_groups[0]["lr"]
        self.num_steps = max(iteration - skipped, 0) * self.increment
        self._apply()
        lr = self.optimizer.param_groups[0]["lr"]
        if saved_samples == self.num_steps and math.isclose(saved_lr, lr, rel_tol=1e-9, abs_tol=0.0):
            return None
        return (f"the LR schedule continues at iteration {iteration} of this run's schedule (lr {lr:.3e}, sample {self.num_steps}), "
                f"not where the checkpoint's left off (lr {saved_lr:.3e}, sample {saved_samples})")

    def load_state_dict(self, state: dict) -> None:
        # checkpoints written before the schedule counted samples hold only the step count
        self.num_steps = state["num_steps"] if "num_steps" in state else state["last_step"] * self.increment
        self._apply()


def continue_schedule(schedule, iteration: int, *, skipped: int, load_optim: bool) -> str | None:
    """After a resume the run trains with its own schedule's rate at the iteration it resumes from, at any layout
    and whatever changed since the save (``WarmupDecayLR.continue_at``); returns the line saying so when that
    differs. A scheduler from the DeepSpeed JSON keeps its own state; --no-load-optim starts the schedule afresh."""
    if not isinstance(schedule, WarmupDecayLR) or not load_optim:
        return None
    return schedule.continue_at(iteration, skipped)
