"""Autograd functions over a loaded fused-ops extension, and the calls that choose per tensor
between them and the PyTorch definitions.

The extension registers its kernels with the dispatcher as ``torch.ops.<namespace>.*``
(see csrc/common.h). Each op also gets a fake (meta) implementation here, so torch.compile
can trace a model that calls them (as opaque custom ops) instead of failing on them.
A call the kernels do not cover (another device, float64, a weight in another dtype than the
input, an odd head dimension, a very wide norm) takes the PyTorch definition; those cases do
not arise in the model's bf16/fp16/fp32 layers.
"""
from __future__ import annotations

from typing import Callable

import torch

from . import reference

KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
MAX_NORM_WIDTH = 16384  # the CUDA backward keeps one fp32 row of weight gradient in shared memory (64 KiB)


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, ops, x, weight, eps):
        y, rstd = ops.rms_norm_fwd(x, weight, eps)
        ctx.save_for_backward(x, weight, rstd)
        ctx.ops = ops
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, rstd = ctx.saved_tensors
        dx, dweight = ctx.ops.rms_norm_bwd(dy.to(x.dtype), x, weight, rstd)
        return None, dx, dweight, None


class _Rotary(torch.autograd.Function):
    @staticmethod
    def forward(ctx, ops, x, cos, sin):
        ctx.save_for_backward(cos, sin)
        ctx.ops = ops
        return ops.rotary_fwd(x, cos, sin)

    @staticmethod
    def backward(ctx, dy):
        cos, sin = ctx.saved_tensors
        dy = dy if dy.stride(-1) == 1 else dy.contiguous()
        return None, ctx.ops.rotary_bwd(dy, cos, sin), None, None


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, ops, h):
        ctx.save_for_backward(h)
        ctx.ops = ops
        return ops.swiglu_fwd(h)

    @staticmethod
    def backward(ctx, dy):
        (h,) = ctx.saved_tensors
        return None, ctx.ops.swiglu_bwd(dy.to(h.dtype), h)


def op_namespace(module) -> object:
    """The ``torch.ops`` namespace an extension registered its kernels in."""
    return getattr(torch.ops, module.op_namespace)


def register_fakes(module) -> None:
    """Shapes and dtypes of each op's outputs, for torch.compile's tracing (once per extension)."""
    if getattr(module, "fakes_registered", False):
        return
    ns = module.op_namespace

    def fake(name):
        return torch.library.register_fake(f"{ns}::{name}")

    @fake("rms_norm_fwd")
    def _(x, weight, eps):
        rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
        return torch.empty_like(x, memory_format=torch.contiguous_format), x.new_empty(rows, dtype=torch.float32)

    @fake("rms_norm_bwd")
    def _(dy, x, weight, rstd):
        return torch.empty_like(x, memory_format=torch.contiguous_format), torch.empty_like(weight)

    @fake("rotary_fwd")
    def _(x, cos, sin):
        return x.new_empty(x.shape)

    @fake("rotary_bwd")
    def _(dy, cos, sin):
        return dy.new_empty(dy.shape)

    @fake("swiglu_fwd")
    def _(h):
        return h.new_empty((*h.shape[:-1], h.shape[-1] // 2))

    @fake("swiglu_bwd")
    def _(dy, h):
        return h.new_empty(h.shape)

    module.fakes_registered = True


def fused_calls(module, device_type: str) -> dict[str, Callable]:
    """The model-facing calls of one loaded extension, keyed by op name (as --fused-ops spells them)."""
    ops = op_namespace(module)
    register_fakes(module)

    def on_device(t: torch.Tensor) -> bool:
        return t.device.type == device_type and t.dtype in KERNEL_DTYPES

    def rms_norm(x, weight, eps):
        if on_device(x) and weight.dtype == x.dtype and weight.device == x.device and 0 < x.shape[-1] <= MAX_NORM_WIDTH:
            return _RMSNorm.apply(ops, x, weight, eps)
        return reference.rms_norm(x, weight, eps)

    def rotary(x, cos, sin):
        if on_device(x) and x.dim() == 4 and x.shape[-1] % 2 == 0 and x.stride(-1) == 1:
            return _Rotary.apply(ops, x, cos.float().contiguous(), sin.float().contiguous())
        return reference.rotary(x, cos, sin)

    def swiglu(h):
        if on_device(h) and h.shape[-1] % 2 == 0:
            return _SwiGLU.apply(ops, h)
        return reference.swiglu(h)

    return {"rmsnorm": rms_norm, "rope": rotary, "swiglu": swiglu}
