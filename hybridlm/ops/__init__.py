"""Fused kernels (RMSNorm, rotary embedding, SwiGLU) JIT-built through DeepSpeed's op builder,
each with a pure-PyTorch fallback. ``select_kernels`` decides per run; ``python -m
hybridlm.ops.report`` shows what would be used here.
"""
from .select import DEFAULT_FUSED, FusedOpsUnavailable, Kernels, reference_kernels, select_kernels

__all__ = ["DEFAULT_FUSED", "FusedOpsUnavailable", "Kernels", "reference_kernels", "select_kernels"]
