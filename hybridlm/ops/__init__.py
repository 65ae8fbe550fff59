"""Fused kernels (RMSNorm, rotary embedding, SwiGLU) JIT-built through DeepSpeed's op builder,
each with a pure-PyTorch fallback. ``select_kernels`` decides per run; ``python -m
hybridlm.ops.report`` shows what would be used here.

The C++/CUDA sources and their op builders live in the top-level ``ops/`` (``csrc/`` and
``op_builder/``, DeepSpeed's layout), reached here as ``csrc`` and ``op_builder`` (links in a
checkout, real folders in a wheel). What stays in the package is Python that decides and
falls back: the reference definitions, the autograd functions over the built extension, the
locked build-and-load, the selection and the report; they import torch and DeepSpeed only.
"""
from .select import DEFAULT_FUSED, FusedOpsUnavailable, Kernels, reference_kernels, select_kernels

__all__ = ["DEFAULT_FUSED", "FusedOpsUnavailable", "Kernels", "reference_kernels", "select_kernels"]
