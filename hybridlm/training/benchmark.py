"""Time a named model and layout: N steps after warm-up, medians of the per-step figures.

Each step is timed by the trainer's own log records (log interval 1, so each record is
one step, closed by a device synchronisation through ``loss.item()``); the first
``warmup`` steps (allocator growth, autotuning, JIT) are dropped.
"""
from __future__ import annotations

import argparse
import datetime
import shlex
import statistics
import sys

import torch
import torch.distributed as dist

from ..presets import model_flags
from .trainer import pretrain


def device_label() -> str:
    if torch.cuda.is_available():
        name = torch.cuda.get_device_name()
        for short in ("H200", "H100", "A100", "L40S"):
            if short in name:
                return short
        return name
    return "CPU"


def run_benchmark(argv: list[str]) -> dict | None:
    parser = argparse.ArgumentParser(description="Benchmark a preset model through the real training path.")
    parser.add_argument("--model", default="reference")
    parser.add_argument("--steps", type=int, default=30, help="timed steps")
    parser.add_argument("--warmup", type=int, default=10, help="untimed steps before")
    parser.add_argument("--label", default=None, help="layout label for the results table (default: the extra flags)")
    parser.add_argument("--results-file", default=None, help="append one markdown row per figure here (rank 0)")
    args, extra = parser.parse_known_args(argv)
    extra = [a for a in extra if a != "--"]
    flags = model_flags(args.model) + extra + ["--train-iters", str(args.warmup + args.steps), "--log-interval", "1"]
    records = pretrain(flags)
    if dist.is_initialized() and dist.get_rank() != 0:
        return None
    timed = records[args.warmup:]
    summary = {
        "tokens_per_sec_per_gpu": statistics.median(r["tokens_per_sec_per_gpu"] for r in timed),
        "tflops_per_gpu": statistics.median(r["tflops_per_gpu"] for r in timed),
        "mfu": statistics.median(r["mfu"] for r in timed) if timed[0]["mfu"] is not None else None,
        "peak_memory_gib": max(r.get("max_memory_gib", 0.0) for r in timed),
        "final_loss": timed[-1]["loss"],
    }
    label = args.label or (" ".join(extra) or "default")
    world = dist.get_world_size() if dist.is_initialized() else 1
    # The command as a user types it: the launcher adds --local_rank itself.
    shown = [a for i, a in enumerate(argv) if a != "--results-file" and not a.startswith("--local_rank")
             and (i == 0 or argv[i - 1] != "--results-file")]
    command = f"deepspeed --num_gpus {world} scripts/benchmark.py " + shlex.join(shown)
    print(f"\nBENCH {args.model} [{label}] on {device_label()}: {summary['tokens_per_sec_per_gpu']:,.0f} tok/s/gpu | "
          f"{summary['tflops_per_gpu']:.1f} TFLOP/s/gpu | MFU "
          f"{100 * summary['mfu']:.1f}% | peak {summary['peak_memory_gib']:.1f} GiB | loss {summary['final_loss']:.3f}"
          if summary["mfu"] is not None else f"\nBENCH {args.model} [{label}]: {summary}", flush=True)
    if args.results_file:
        date = datetime.date.today().isoformat()
        rows = [f"{summary['tokens_per_sec_per_gpu']:,.0f} tok/s/GPU", f"{summary['tflops_per_gpu']:.1f} TFLOP/s/GPU"]
        if summary["mfu"] is not None:
            rows.append(f"{100 * summary['mfu']:.1f}% MFU")
        rows.append(f"{summary['peak_memory_gib']:.1f} GiB peak")
        with open(args.results_file, "a") as f:
            for figure in rows:
                f.write(f"| {date} | {world}x {device_label()} | {args.model} | {label} | {figure} | `{command}` |\n")
    return summary


def main() -> int:
    run_benchmark(sys.argv[1:])
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    return 0
