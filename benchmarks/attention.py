"""Causal attention fwd+bwd TFLOP/s of each installed backend, bf16, at one shape.

FLOPs follow flash-attn's convention: a causal forward is 2 matmuls of 2*B*H*S*S*D / 2
each, and the backward is 2.5x the forward. Timing: CUDA events around N iterations after
warm-up (the first calls autotune or compile).

    python benchmarks/attention.py --batch 4 --heads 16 --seq 4096 --head-dim 128 [--record-file R.jsonl]
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.records import append, script_record  # noqa: E402
from hybridlm.model.attention_backends import BACKENDS, make_attention_core, resolve_backend  # noqa: E402


def time_fwd_bwd(core, q, k, v, grad, iters: int, warmup: int) -> float:
    for _ in range(warmup):
        core(q, k, v, 0.0).backward(grad)
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        core(q, k, v, 0.0).backward(grad)
    stop.record()
    torch.cuda.synchronize()
    return start.elapsed_time(stop) / 1e3 / iters


def _load_transformer_engine_first() -> None:
    """Transformer Engine loads its own cuDNN libraries; once torch has initialised cuDNN
    (the sdpa/cudnn rows run first) that load fails, so import it before anything runs."""
    try:
        import transformer_engine.pytorch  # noqa: F401
    except ImportError:
        pass


def main() -> int:
    _load_transformer_engine_first()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--groups", type=int, default=None, help="KV heads (default: heads)")
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--record-file", default=None, help="append one JSON record per backend (the benchmark suite's)")
    args = parser.parse_args()
    groups = args.groups or args.heads
    b, h, s, d = args.batch, args.heads, args.seq, args.head_dim
    flops = 3.5 * (4 * b * h * s * s * d / 2)
    rows = []
    for backend in BACKENDS:
        try:
            resolve_backend(backend)
        except ValueError as e:
            print(f"{backend:6s} skipped: {e}")
            continue
        core = make_attention_core(backend, heads=h, groups=groups, head_dim=d, dropout=0.0)
        q = torch.randn(s, b, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        k = torch.randn(s, b, groups, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        v = torch.randn(s, b, groups, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        grad = torch.randn_like(q)
        seconds = time_fwd_bwd(core, q, k, v, grad, args.iters, warmup=3)
        tflops = flops / seconds / 1e12
        print(f"{backend:6s} {seconds * 1e3:8.2f} ms  {tflops:6.1f} TFLOP/s fwd+bwd")
        rows.append((backend, tflops))
    for backend, tflops in rows if args.record_file else ():
        append(args.record_file, script_record("python benchmarks/attention.py", sys.argv[1:],
                                               f"causal attention B{b} H{h} S{s} D{d} bf16, --attention-backend {backend}, fwd+bwd",
                                               {"TFLOP/s": f"{tflops:.0f}"}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
