"""Transformer Engine as the rank-local matmul of the tensor-parallel linears, and FP8.

``--transformer-impl transformer_engine`` keeps this project's TP/SP communication (the
column/row linears in ``parallel.tensor_parallel``) and swaps only the local GEMM for TE's
``Linear``, so that inside ``fp8_autocast`` the GEMM runs in FP8 with TE's scaling state.
The TE module computes with *our* parameters (same names, same sharding tags, same
initialisation and checkpoints as the local implementation); it is kept off the module
tree, so its FP8 scaling history is not part of a checkpoint (a resumed FP8 run rebuilds
the amax history within ``--fp8-amax-history-len`` steps).
"""
from __future__ import annotations

import contextlib
from typing import Optional

import torch
from torch import nn

from ..config import ModelConfig


class TELocalMatmul:
    """y = x W^T (+ b) through ``transformer_engine.pytorch.Linear`` on the caller's parameters."""

    def __init__(self, weight: nn.Parameter, bias: Optional[nn.Parameter]):
        import transformer_engine.pytorch as te
        out_features, in_features = weight.shape
        linear = te.Linear(in_features, out_features, bias=bias is not None, params_dtype=weight.dtype, device=weight.device)
        # TE reads its weights by attribute name at every call: point them at ours.
        del linear.weight
        linear.weight = weight
        if bias is not None:
            del linear.bias
            linear.bias = bias
        self.linear = linear

    @torch.compiler.disable
    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        # Under --torch-compile the layer's graphs break around TE's GEMM (TE's autograd
        # functions and FP8 scaling state are not traceable); the norms, RoPE, attention and
        # SwiGLU between the GEMMs still compile.
        return self.linear(x)


class TELocalNormMatmul:
    """y = norm(x) W^T (+ b) through ``transformer_engine.pytorch.LayerNormLinear``: the norm and
    the GEMM's input cast (FP8 under autocast) in one kernel, on the caller's parameters.

    Used where a column-parallel linear directly follows a norm on the full sequence (QKV and a
    dense MLP's first linear, without sequence parallelism: with SP an all-gather sits between
    the two). The norm module stays registered where it was (its parameter names and
    checkpoints are unchanged); this object only reads its weight and epsilon."""

    def __init__(self, norm: nn.Module, weight: nn.Parameter, bias: Optional[nn.Parameter]):
        import transformer_engine.pytorch as te
        out_features, in_features = weight.shape
        layer_norm = isinstance(norm, nn.LayerNorm)
        fused = te.LayerNormLinear(in_features, out_features, eps=float(norm.eps), bias=bias is not None,
                                   normalization="LayerNorm" if layer_norm else "RMSNorm",
                                   params_dtype=weight.dtype, device=weight.device)
        del fused.weight, fused.layer_norm_weight
        fused.weight, fused.layer_norm_weight = weight, norm.weight
        if bias is not None:
            del fused.bias
            fused.bias = bias
        if layer_norm:
            del fused.layer_norm_bias
            fused.layer_norm_bias = norm.bias
        self.fused = fused

    @torch.compiler.disable
    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.fused(x)


def fp8_recipe(cfg: ModelConfig):
    """TE's recipe object for ``--fp8-format``/``--fp8-recipe``, or None without FP8."""
    if not cfg.fp8_format:
        return None
    from transformer_engine.common import recipe
    fmt = recipe.Format.HYBRID if cfg.fp8_format == "hybrid" else recipe.Format.E4M3
    if cfg.fp8_recipe == "current":
        return recipe.Float8CurrentScaling(fp8_format=fmt)
    return recipe.DelayedScaling(fp8_format=fmt, amax_history_len=cfg.fp8_amax_history_len, amax_compute_algo="max")


def fp8_context(recipe_object):
    """The context the transformer layers run their forward in: FP8 autocast, or nothing."""
    if recipe_object is None:
        return contextlib.nullcontext()
    import transformer_engine.pytorch as te
    return te.fp8_autocast(enabled=True, fp8_recipe=recipe_object)
