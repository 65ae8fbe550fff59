"""Which implementation each fused op runs: the kernel from the op builder, or PyTorch.

``select_kernels`` is called once per run, where the layer factory is built; the model's
norm, rotary embedding and MLP call the returned object's ``rms_norm``, ``rotary`` and
``swiglu`` and never ask which implementation they got. Rank 0 logs one line saying which
path each op takes and why.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
from deepspeed.ops.op_builder.builder import OpBuilder

from ..config import FUSED_OPS, ConfigError
from . import reference
from .op_builder import builder_for
from .functions import fused_calls
from .jit import BuildOutcome, build_and_load

# --fused-ops auto: the ops that run fused by default, per device type. On CPU none: the
# default CPU run stays free of C++ builds. On CUDA an op stays on only where its kernel beat
# torch.compile of the same function in benchmarks/kernels.py (see benchmarks/RESULTS.md).
DEFAULT_FUSED: dict[str, tuple[str, ...]] = {
    "cpu": (),
    "cuda": (),  # none beat torch.compile fwd+bwd on an H200 (benchmarks/RESULTS.md); --fused-ops all for +34% in eager
}


class FusedOpsUnavailable(ConfigError):
    """--require-fused-ops, and a requested kernel cannot be built or loaded here."""


@dataclass(frozen=True)
class Kernels:
    """The op implementations the model calls, and the names of those running fused kernels."""

    rms_norm: Callable = reference.rms_norm  # (x, weight, eps) -> y
    rotary: Callable = reference.rotary  # (x [s, b, heads, d], cos [s, d], sin [s, d]) -> like x
    swiglu: Callable = reference.swiglu  # (h [..., 2f]) -> [..., f]
    fused: tuple[str, ...] = ()
    paths: dict = field(default_factory=dict)  # op -> "fused (why)" / "PyTorch (why)"

    def summary(self) -> str:
        """Ops grouped by the path they take: 'rmsnorm, rope fused (...); swiglu PyTorch (not requested)'."""
        groups: dict[str, list[str]] = {}
        for op, path in self.paths.items():
            groups.setdefault(path, []).append(op)
        return "; ".join(f"{', '.join(ops)} {path}" for path, ops in groups.items())


def reference_kernels() -> Kernels:
    return Kernels(paths={op: "PyTorch" for op in FUSED_OPS})


def _is_rank0() -> bool:
    return not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0


def _print(message: str) -> None:
    print(message, flush=True)


def select_kernels(requested: Optional[tuple[str, ...]], *, require: bool, device,
                   log: Optional[Callable[[str], None]] = None, builder: Optional[OpBuilder] = None) -> Kernels:
    """Build or load the kernels for ``requested`` ops (None: this device's defaults) on ``device``.

    A kernel that cannot be built falls back to PyTorch with the reason in the log line, or,
    with ``require``, raises FusedOpsUnavailable (one sentence). ``log`` defaults to printing on
    rank 0; ``builder`` replaces the device's own (tests build deliberately broken ones).
    """
    device_type = torch.device(device).type
    log = log or (_print if _is_rank0() else (lambda _: None))
    wanted = DEFAULT_FUSED.get(device_type, ()) if requested is None else tuple(requested)
    unknown = [op for op in wanted if op not in FUSED_OPS]
    if unknown:
        raise ConfigError(f"--fused-ops: unknown kernel {unknown[0]!r} (have: {', '.join(FUSED_OPS)}).")
    paths = {op: "PyTorch (not requested)" if requested is not None else f"PyTorch (auto: off on {device_type})"
             for op in FUSED_OPS}
    calls = {"rmsnorm": reference.rms_norm, "rope": reference.rotary, "swiglu": reference.swiglu}
    fused: tuple[str, ...] = ()
    if wanted:
        builder = builder or builder_for(device_type)
        outcome = (build_and_load(builder, log=lambda m: log(f"hybridlm: {m}")) if builder is not None else
                   BuildOutcome(None, "incompatible", f"no fused kernels for {device_type} devices"))
        if outcome.ok:
            built = fused_calls(outcome.module, device_type)
            for op in wanted:
                calls[op] = built[op]
                paths[op] = f"fused ({builder.name}: {outcome.detail})"
            fused = tuple(op for op in FUSED_OPS if op in wanted)
        else:
            what = "build failed" if outcome.status == "failed" else "not available"
            if require:
                raise FusedOpsUnavailable(f"--require-fused-ops: the fused {', '.join(wanted)} kernel(s) cannot be used "
                                          f"on {device_type}: {what}: {outcome.detail}.")
            for op in wanted:
                paths[op] = f"PyTorch ({what}: {outcome.detail})"
    kernels = Kernels(rms_norm=calls["rmsnorm"], rotary=calls["rope"], swiglu=calls["swiglu"], fused=fused, paths=paths)
    log(f"hybridlm: fused ops: {kernels.summary()}")
    return kernels
