"""LoRA adapters beside the tensor-parallel linears: y = W x + (alpha / R) B A dropout(x), W frozen.

Each adapter is split over TP the way its base linear is, so that neither factor is ever
gathered whole and the extra communication is an [s, b, R] tensor:

    column-parallel base (W's output rows split): A [R, in] replicated, B [out/TP, R] split on the
        output dimension (block by block for QKV and gate/up, like W). A's product crosses into
        the TP region as the base's input does (copy, or under SP the sequence all-gather), so
        B sees every token and A sees this rank's tokens.
    row-parallel base (W's input columns split): A [R, in/TP] split on the input dimension, its
        partial product summed over TP as the base's is (all-reduce, or under SP reduce-scatter);
        B [out, R] replicated, applied to the summed product.

Under sequence parallelism the replicated factor (the column's A, the row's B) sees only its
rank's tokens, so its gradient is a per-rank partial sum: completed by an all-reduce over TP,
the rule the norms follow (``sum_grad_over_tp``). Without SP it sees every token and needs none.

One adapter per weight as it is stored: the fused QKV linear gets one A [R, hidden] and one
B [q + k + v, R], SwiGLU's fc1 one A and one B [2 ffn, R] for gate and up together. That is a
different model from PEFT's separate q/k/v (gate/up) adapters (one shared A, rank R in all),
though merged into the base it is an ordinary dense weight again (``hybridlm.interop.lora``).

B starts at zero (PEFT's default), A uniform within +-1/sqrt(in) (PEFT's Kaiming rule), so the
adapted model starts as the base. ``add_adapters`` attaches them to a built model (any stage),
freezes everything else, and is the only place that knows which module names are targets.

With ``--quant-bits 4`` (QLoRA) the frozen linears hold their weights in 4 bits
(``hybridlm.parallel.quantized``): an adapter sees only the base weight's shape, device and dtype.
"""
from __future__ import annotations

import contextlib
import math
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from .sequence import reduce_scatter_to_sequence, sum_grad_over_tp
from .state import GroupHandle
from .tensor_parallel import (ColumnParallelLinear, RowParallelLinear, Sharding, column_parallel_matmul,
                              reduce_from_tensor_parallel, tag_parameter)

# --lora-targets name -> the attribute name of the linear in the blocks (hybridlm.model.gpt)
TARGET_MODULES = {"qkv": ("attention", "qkv"), "proj": ("attention", "proj"), "fc1": ("mlp", "fc1"), "fc2": ("mlp", "fc2")}


class LoRA(nn.Module):
    """The adapter of one column- or row-parallel linear; ``forward`` returns the term added to its output."""

    def __init__(self, linear: nn.Module, rank: int, alpha: float, dropout: float, tp: GroupHandle, *,
                 sequence_parallel: bool, rng: Callable):
        super().__init__()
        weight = linear.weight
        self.column = isinstance(linear, ColumnParallelLinear)
        self.tp, self.sequence_parallel, self.rng = tp, sequence_parallel, rng
        self.scale, self.dropout = alpha / rank, dropout
        self.enabled = True
        make = lambda *shape: nn.Parameter(torch.empty(*shape, device=weight.device, dtype=weight.dtype))  # noqa: E731
        if self.column:
            full_in = weight.shape[1]
            self.a = tag_parameter(make(rank, full_in), None)
            self.b = tag_parameter(make(weight.shape[0], rank), Sharding(0, linear.output_sizes), init_value=0.0)
            replicated = self.a
        else:
            full_in = weight.shape[1] * tp.size
            self.a = tag_parameter(make(rank, weight.shape[1]), Sharding(1, (full_in,)))
            self.b = tag_parameter(make(weight.shape[0], rank), None, init_value=0.0)
            replicated = self.b
        self.a.init_bound = 1.0 / math.sqrt(full_in)
        if sequence_parallel:
            sum_grad_over_tp(replicated, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x``: the base linear's input as it arrives (sequence slice under SP for a column linear,
        this rank's input columns for a row linear)."""
        if self.dropout and self.training:
            with self.rng():
                x = F.dropout(x, self.dropout)
        h = F.linear(x, self.a)
        if self.column:
            return column_parallel_matmul(h, self.b, None, self.tp, self.sequence_parallel) * self.scale
        h = reduce_scatter_to_sequence(h, self.tp) if self.sequence_parallel else reduce_from_tensor_parallel(h, self.tp)
        return F.linear(h, self.b) * self.scale


def lora_alpha(cfg) -> float:
    """--lora-alpha, or R when not given (a scale of 1)."""
    return cfg.lora_alpha if cfg.lora_alpha is not None else float(cfg.lora_rank)


def add_adapters(model: nn.Module, cfg, factory) -> int:
    """Attach a LoRA adapter to each target linear of this rank's layers (``cfg.lora_target_names()``),
    freeze every other parameter; returns the number of adapters. Before initialisation: the
    adapters' parameters are initialised from the seed by name like the rest."""
    wanted = {TARGET_MODULES[name] for name in cfg.lora_target_names()}
    alpha = lora_alpha(cfg)
    for param in model.parameters():
        param.requires_grad_(False)
    count = 0
    for name, module in list(model.named_modules()):
        parts = name.split(".")
        if len(parts) < 2 or tuple(parts[-2:]) not in wanted or not isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
            continue
        column = isinstance(module, ColumnParallelLinear)
        rng = factory.rng.region if column else factory.rng.split  # the input: replicated or a sequence slice; or TP-split columns
        module.lora = LoRA(module, cfg.lora_rank, alpha, cfg.lora_dropout, factory.tp, sequence_parallel=factory.sequence_parallel,
                           rng=rng)
        count += 1
    return count


def is_adapter_name(name: str) -> bool:
    return name.endswith((".lora.a", ".lora.b"))


@contextlib.contextmanager
def adapters_disabled(model: nn.Module):
    """Run ``model`` as its frozen base (DPO's reference with LoRA: the same model, no second copy)."""
    adapters = [m for m in model.modules() if isinstance(m, LoRA)]
    for adapter in adapters:
        adapter.enabled = False
    try:
        yield
    finally:
        for adapter in adapters:
            adapter.enabled = True


def describe_adapters(model: nn.Module, cfg) -> str:
    """One log line: what is trained, and how much of this rank's model it is (a 4-bit base's weights included)."""
    from .quantized import describe_base, quantized_weights  # QLoRA's base, which imports this module
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters()) + sum(w.numel() for _, w in quantized_weights(model))
    alpha = lora_alpha(cfg)
    return (f"LoRA rank {cfg.lora_rank}, alpha {alpha:g} (scale {alpha / cfg.lora_rank:g}), dropout {cfg.lora_dropout:g}, on "
            f"{','.join(cfg.lora_target_names())} (one adapter per fused weight): {trainable:,} trainable parameters of "
            f"{total:,} on this rank ({100.0 * trainable / max(total, 1):.2f}%); the base is frozen and has no optimizer "
            f"state{describe_base(model)}")
