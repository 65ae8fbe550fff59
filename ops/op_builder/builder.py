"""DeepSpeed op builders for the fused kernels: one extension per device kind.

They live beside the C++/CUDA sources in the top-level ``ops/`` (``ops/op_builder/`` next to
``ops/csrc/``), as DeepSpeed keeps ``op_builder/`` beside ``csrc/``; a wheel installs both as
``hybridlm/ops/op_builder`` and ``hybridlm/ops/csrc`` (setup.py's ``package_dir``), so the sources
are found the same way from a checkout, an editable install and ``pip install .``: beside this folder.

Both subclass DeepSpeed's own builders, so the build goes through the same path as
DeepSpeed's ops (``OpBuilder.load`` -> ``jit_load`` -> ``torch.utils.cpp_extension.load``,
cached in TORCH_EXTENSIONS_DIR) and takes the same environment (TORCH_CUDA_ARCH_LIST,
DS_NVCC_THREADS, CXX). The three kernels share one extension per device: one compile of
the PyTorch headers instead of three, which is most of the build time on a CI machine.

``compatibility()`` says in one phrase why a builder cannot build here (None when it can);
DeepSpeed's ``is_compatible`` answers from it.
"""
from __future__ import annotations

import os
import shutil
from typing import Optional

import torch
from deepspeed.ops.op_builder.builder import CUDAOpBuilder, OpBuilder, assert_no_cuda_mismatch, installed_cuda_version
from deepspeed.ops.op_builder.cpu.builder import CPUOpBuilder

# ../csrc from here: ops/csrc in a checkout, hybridlm/ops/csrc in an installed package
CSRC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "csrc")


def _missing_build_tools() -> Optional[str]:
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        return f"no C++ compiler ({compiler}) on PATH"
    try:
        from torch.utils.cpp_extension import verify_ninja_availability
        verify_ninja_availability()
    except RuntimeError:
        return "ninja is not installed (pip install ninja)"
    return None


class _Compatibility:
    """DeepSpeed's is_compatible(), answered from compatibility() with the reason kept in error_log."""

    def compatibility(self) -> Optional[str]:
        raise NotImplementedError

    def is_compatible(self, verbose: bool = False) -> bool:
        reason = self.compatibility()
        self.error_log = reason
        if reason and verbose:
            self.warning(f"{self.name}: {reason}")
        return reason is None


class FusedOpsCPUBuilder(_Compatibility, CPUOpBuilder):
    """RMSNorm, rotary embedding and SwiGLU for CPU (C++ over ATen's thread pool)."""

    NAME = "hybridlm_fused_cpu"
    BUILD_VAR = "DS_BUILD_HYBRIDLM_FUSED_CPU"

    def __init__(self, name: str = NAME):
        super().__init__(name=name)

    def absolute_name(self) -> str:
        return f"hybridlm.ops.{self.name}"

    def sources(self) -> list[str]:
        return [os.path.join(CSRC, "cpu", "fused_ops.cpp")]

    def include_paths(self) -> list[str]:
        return [CSRC]

    def cxx_args(self) -> list[str]:
        # DeepSpeed's CPU flags add -g and -march=native: slower to build, and a cached build
        # could then crash on another machine sharing the extensions directory.
        return ["-O3", "-fopenmp"]

    def compatibility(self) -> Optional[str]:
        return _missing_build_tools()


class FusedOpsCUDABuilder(_Compatibility, CUDAOpBuilder):
    """RMSNorm, rotary embedding and SwiGLU for NVIDIA GPUs (nvcc; bf16, fp16 and fp32)."""

    NAME = "hybridlm_fused_cuda"
    BUILD_VAR = "DS_BUILD_HYBRIDLM_FUSED_CUDA"

    def __init__(self, name: str = NAME):
        super().__init__(name=name)

    def absolute_name(self) -> str:
        return f"hybridlm.ops.{self.name}"

    def sources(self) -> list[str]:
        cuda = os.path.join(CSRC, "cuda")
        return [os.path.join(cuda, f) for f in ("fused_ops.cpp", "rms_norm.cu", "rotary.cu", "swiglu.cu")]

    def include_paths(self) -> list[str]:
        return [CSRC]

    def cxx_args(self) -> list[str]:
        return [a for a in super().cxx_args() if a != "-g"]

    def nvcc_args(self) -> list[str]:
        # No --use_fast_math: these kernels are memory-bound, and exact expf/division keep the
        # fp32 results within 1e-5 of PyTorch's.
        return [a for a in super().nvcc_args() if a != "--use_fast_math"]

    def compatibility(self) -> Optional[str]:
        if torch.version.cuda is None:
            return f"this PyTorch ({torch.__version__}) is not a CUDA build"
        missing = _missing_build_tools()
        if missing:
            return missing
        from torch.utils.cpp_extension import CUDA_HOME
        if CUDA_HOME is None or not os.path.exists(os.path.join(CUDA_HOME, "bin", "nvcc")):
            return "no CUDA toolkit (nvcc) found; set CUDA_HOME"
        try:
            assert_no_cuda_mismatch(self.name)
            major, minor = installed_cuda_version()
        except Exception as e:  # noqa: BLE001 - DeepSpeed raises its own mismatch/missing exceptions
            return str(e).strip().lstrip(">- ")
        if not torch.cuda.is_available():
            return f"no CUDA device visible (nvcc {major}.{minor} found)"
        cc = torch.cuda.get_device_capability()
        if cc < (7, 0):
            return f"compute capability {cc[0]}.{cc[1]} is below 7.0"
        return None


def builder_for(device_type: str, name: Optional[str] = None) -> Optional[OpBuilder]:
    """The builder for a torch device type ('cpu', 'cuda'), or None where there is none."""
    cls = {"cpu": FusedOpsCPUBuilder, "cuda": FusedOpsCUDABuilder}.get(device_type)
    if cls is None:
        return None
    return cls(name) if name else cls()
