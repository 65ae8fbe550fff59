"""Fused kernels against eager PyTorch and torch.compile of the same function, bf16, at the
reference model's shapes (mb4 x seq2048 = 8192 tokens, hidden 2048, 16 heads x 128, ffn 5504).

For each op, forward and forward+backward: GPU time (median over iterations) and the achieved
bandwidth, counting only the bytes the op must move (each input read once, each output written
once), against the device's copy ceiling measured here (a large ``copy_``: read + write). The
last column says whether the fused kernel beats torch.compile in forward+backward: the rule for
leaving it on under ``--fused-ops auto`` (hybridlm/ops/select.py, DEFAULT_FUSED).

Timing: the GPU is first kept busy (torch.cuda._sleep) while every timed iteration is queued,
so CPU launch overhead does not count; L2 is flushed before each iteration (a 256 MiB write);
one CUDA event pair per iteration.

    python benchmarks/kernels.py [--tokens 8192 --hidden 2048 --heads 16 --head-dim 128 --ffn 5504] [--record-file R.jsonl]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
from dataclasses import dataclass
from typing import Callable

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from hybridlm.config import FUSED_OPS  # noqa: E402
from benchmarks.records import append, script_record  # noqa: E402
from hybridlm.ops import reference, select_kernels  # noqa: E402


def gpu_times_ms(fn: Callable[[], object], iters: int, warmup: int, flush: torch.Tensor) -> float:
    """Median GPU time of ``fn`` in ms, launch overhead excluded, cold L2."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
    torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time for the CPU to queue everything below
    for start, stop in events:
        flush.zero_()
        start.record()
        fn()
        stop.record()
    torch.cuda.synchronize()
    return statistics.median(start.elapsed_time(stop) for start, stop in events)


def copy_ceiling_gbs(flush: torch.Tensor, iters: int) -> float:
    """Device copy bandwidth (GB/s, read + write) of a 1 GiB copy_."""
    src = torch.empty(1 << 29, dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty_like(src)
    ms = gpu_times_ms(lambda: dst.copy_(src), iters, 3, flush)
    return 2 * src.numel() * src.element_size() / (ms / 1e3) / 1e9


@dataclass
class Case:
    """One op at one shape: the call for each implementation and the bytes it must move."""

    op: str
    shape: str
    inputs: list  # tensors; the differentiable ones have requires_grad
    grad_out: torch.Tensor
    call: Callable  # (implementation, *inputs) -> output
    bytes_fwd: int
    bytes_bwd: int


def make_cases(args, dtype) -> list[Case]:
    t, h, heads, d, f = args.tokens, args.hidden, args.heads, args.head_dim, args.ffn
    e = torch.tensor([], dtype=dtype).element_size()
    seq, batch = args.seq, t // args.seq
    dev = "cuda"
    x = torch.randn(seq, batch, h, device=dev, dtype=dtype, requires_grad=True)
    w = (1 + 0.1 * torch.randn(h, device=dev)).to(dtype).requires_grad_()
    # q as the model hands it over: a view into the fused QKV output (no GQA in the reference model).
    qkv = torch.randn(seq, batch, 3 * heads * d, device=dev, dtype=dtype, requires_grad=True)
    angles = torch.outer(torch.arange(seq, device=dev, dtype=torch.float32), 1e-4 ** (torch.arange(0, d, 2, device=dev) / d))
    cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()
    hh = torch.randn(seq, batch, 2 * f, device=dev, dtype=dtype, requires_grad=True)
    return [
        Case("rmsnorm", f"{t}x{h}", [x, w], torch.randn_like(x), lambda impl, a, b: impl.rms_norm(a, b, 1e-5),
             bytes_fwd=2 * t * h * e + 4 * t, bytes_bwd=3 * t * h * e + 4 * t),
        Case("rope", f"q {t}x{heads}x{d} in qkv", [qkv], torch.randn(seq, batch, heads, d, device=dev, dtype=dtype),
             lambda impl, a: impl.rotary(a[..., : heads * d].unflatten(-1, (heads, d)), cos, sin),
             bytes_fwd=2 * t * heads * d * e, bytes_bwd=2 * t * heads * d * e),
        Case("swiglu", f"{t}x{2 * f}->{f}", [hh], torch.randn(seq, batch, f, device=dev, dtype=dtype),
             lambda impl, a: impl.swiglu(a), bytes_fwd=3 * t * f * e, bytes_bwd=5 * t * f * e),
    ]


class Compiled:
    """torch.compile of each PyTorch definition (the same functions the model falls back to)."""

    def __init__(self):
        self.rms_norm = torch.compile(reference.rms_norm, dynamic=False)
        self.rotary = torch.compile(reference.rotary, dynamic=False)
        self.swiglu = torch.compile(reference.swiglu, dynamic=False)


class Eager:
    rms_norm, rotary, swiglu = staticmethod(reference.rms_norm), staticmethod(reference.rotary), staticmethod(reference.swiglu)


def measure(case: Case, impl, iters: int, flush: torch.Tensor) -> tuple[float, float]:
    """(forward ms, forward+backward ms)."""
    differentiable = [t for t in case.inputs if t.requires_grad]

    def forward():
        with torch.no_grad():
            return case.call(impl, *case.inputs)

    def forward_backward():
        out = case.call(impl, *case.inputs)
        return torch.autograd.grad(out, differentiable, case.grad_out)

    return gpu_times_ms(forward, iters, 5, flush), gpu_times_ms(forward_backward, iters, 5, flush)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=8192, help="micro-batch x sequence")
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--ffn", type=int, default=5504)
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--record-file", default=None, help="append one JSON record per op and implementation (the benchmark suite's)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("benchmarks/kernels.py needs a CUDA GPU", file=sys.stderr)
        return 2
    fused = select_kernels(FUSED_OPS, require=True, device="cuda")
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    ceiling = copy_ceiling_gbs(flush, args.iters)
    name = torch.cuda.get_device_name()
    print(f"{name}: copy ceiling {ceiling:,.0f} GB/s (1 GiB copy_, read + write)")
    impls = {"eager": Eager(), "torch.compile": Compiled(), "fused": fused}
    header = f"{'op':8s} {'pass':9s} {'eager us':>9s} {'compile us':>11s} {'fused us':>9s} {'fused GB/s':>11s} {'of copy':>8s} {'vs compile':>11s}"
    print(header)
    rows, verdict = {}, {}
    for case in make_cases(args, torch.bfloat16):
        times = {label: measure(case, impl, args.iters, flush) for label, impl in impls.items()}
        for pass_index, (label, nbytes) in enumerate((("fwd", case.bytes_fwd), ("fwd+bwd", case.bytes_fwd + case.bytes_bwd))):
            ms = {impl: times[impl][pass_index] for impl in impls}
            gbs = {impl: nbytes / (ms[impl] / 1e3) / 1e9 for impl in impls}
            speedup = ms["torch.compile"] / ms["fused"]
            print(f"{case.op:8s} {label:9s} {ms['eager'] * 1e3:9.1f} {ms['torch.compile'] * 1e3:11.1f} {ms['fused'] * 1e3:9.1f} "
                  f"{gbs['fused']:11,.0f} {gbs['fused'] / ceiling:8.0%} {speedup:10.2f}x")
            if label == "fwd+bwd":
                verdict[case.op] = speedup > 1.0
            for impl in impls:
                rows.setdefault(f"{case.op} {case.shape} bf16, {impl}", {})[label] = (
                    f"{ms[impl] * 1e3:.1f} us ({gbs[impl]:,.0f} GB/s, {gbs[impl] / ceiling:.0%} of copy)")
    on = [op for op in FUSED_OPS if verdict.get(op)]
    print(f"beats torch.compile in fwd+bwd (keep on under --fused-ops auto): {', '.join(on) or 'none'}")
    if args.record_file:
        append(args.record_file, script_record("python benchmarks/kernels.py", sys.argv[1:], "copy_ 1 GiB bf16, read + write",
                                               {"device copy": f"{ceiling:,.0f} GB/s"}))
        for label, figures in rows.items():
            append(args.record_file, script_record("python benchmarks/kernels.py", sys.argv[1:], label, figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
