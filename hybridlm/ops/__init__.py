"""Fused kernels (RMSNorm, rotary embedding, SwiGLU) JIT-built through DeepSpeed's op builder,
each with a pure-PyTorch fallback. ``select_kernels`` decides per run; ``python -m
hybridlm.ops.report`` shows what would be used here.

The C++/CUDA sources and their op builders live in the top-level ``ops/`` (``csrc/`` and
``op_builder/``, DeepSpeed's layout) and are imported as ``hybridlm.ops.op_builder``: in a wheel
setup.py installs them there (``package_dir``), and in a checkout this package's ``__path__``
reaches into ``ops/`` (no symbolic links: they do not survive every copy of a tree). What stays in
the package is Python that decides and falls back: the reference definitions, the autograd
functions over the built extension, the locked build-and-load, the selection and the report;
they import torch and DeepSpeed only.
"""
import os

_CHECKOUT_OPS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "ops")
if os.path.isdir(os.path.join(_CHECKOUT_OPS, "op_builder")):
    __path__.append(_CHECKOUT_OPS)  # noqa: F821 - a package's own search path

from .select import DEFAULT_FUSED, FusedOpsUnavailable, Kernels, reference_kernels, select_kernels

__all__ = ["DEFAULT_FUSED", "FusedOpsUnavailable", "Kernels", "reference_kernels", "select_kernels"]
