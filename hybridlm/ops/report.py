"""What the fused ops would do on this machine, in the spirit of DeepSpeed's ``ds_report``:

    python -m hybridlm.ops.report

For each op and device kind: whether its extension can be built here (compiler, ninja,
CUDA toolkit and device) and why not, whether a build is in the cache (TORCH_EXTENSIONS_DIR),
and whether a run with the default ``--fused-ops auto`` uses it. Builds nothing; exit code 0.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

import torch

from ..config import FUSED_OPS
from .op_builder import builder_for
from .jit import build_directory
from .select import DEFAULT_FUSED


def _first_line(command: list[str]) -> str:
    try:
        out = subprocess.run(command, capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return "?"
    lines = [ln for ln in out.splitlines() if ln.strip()]
    return lines[0].strip() if lines else "?"


def _nvcc() -> str:
    from torch.utils.cpp_extension import CUDA_HOME
    nvcc = os.path.join(CUDA_HOME, "bin", "nvcc") if CUDA_HOME else shutil.which("nvcc")
    if not nvcc or not os.path.exists(nvcc):
        return "not found"
    release = [ln for ln in subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout.splitlines()
               if "release" in ln]
    return f"{nvcc} ({release[0].split('release')[-1].strip()})" if release else nvcc


def _cache_state(builder) -> str:
    """'yes', 'stale (rebuilds on first use)' or 'no', from the cached library and the sources' times."""
    library = os.path.join(build_directory(builder.name, create=False), f"{builder.name}.so")
    if not os.path.exists(library):
        return "no"
    built = os.path.getmtime(library)
    headers = [os.path.join(root, f) for d in builder.include_paths() for root, _, files in os.walk(d) for f in files]
    newer = any(os.path.getmtime(s) > built for s in builder.sources() + headers)
    return "stale (rebuilds on first use)" if newer else "yes"


def report_lines() -> list[str]:
    import deepspeed

    run_device = "cuda" if torch.cuda.is_available() else "cpu"
    cxx = os.environ.get("CXX", "c++")
    lines = [
        "hybridlm fused ops report",
        "-" * 72,
        f"torch {torch.__version__} (CUDA {torch.version.cuda or 'none'}), deepspeed {deepspeed.__version__}, "
        f"training device here: {run_device}",
        f"C++ compiler: {_first_line([cxx, '--version']) if shutil.which(cxx) else 'not found'} ({cxx})",
        f"ninja: {_first_line(['ninja', '--version']) if shutil.which('ninja') else 'not found'}",
        f"nvcc: {_nvcc()}",
        f"extensions directory: {os.path.dirname(build_directory(builder_for('cpu').name, create=False))}",
        "-" * 72,
    ]
    rows = [("op", "device", "extension", "compatible", "built", "used by --fused-ops auto")]
    for device_type in ("cpu", "cuda"):
        builder = builder_for(device_type)
        why_not = builder.compatibility()
        compatible = "yes" if why_not is None else f"no: {why_not}"
        built = _cache_state(builder)
        for op in FUSED_OPS:
            if device_type != run_device:
                used = "- (not this machine's device)"
            elif op not in DEFAULT_FUSED.get(device_type, ()):
                used = f"no (auto: off on {device_type})"
            elif why_not is not None:
                used = "no (falls back to PyTorch: not compatible)"
            else:
                used = "yes" if built == "yes" else "yes (built on first use)"
            rows.append((op, device_type, builder.name, compatible, built, used))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    for row in rows:
        lines.append("  ".join(cell.ljust(w) for cell, w in zip(row, widths)) + "  " + row[-1])
    return lines


def main() -> int:
    print("\n".join(report_lines()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
