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

from ..config import ConfigError, parse_args, world_size_from_env
from .baselines import BASELINES, Shape, run_baseline
from .distributed import init_distributed
from .metrics import flops_per_token, peak_tflops
from .trainer import prepare_config, pretrain


def device_label() -> str:
    if torch.cuda.is_available():
        name = torch.cuda.get_device_name()
        for short in ("H200", "H100", "A100", "L40S"):
            if short in name:
                return short
        return name
    return "CPU"


BASELINE_LABELS = {"torch": "plain PyTorch eager, bf16 autocast, fused AdamW",
                   "torch-compile": "plain PyTorch + torch.compile, bf16 autocast, fused AdamW",
                   "hf-zero2": "HF LlamaForCausalLM + DeepSpeed ZeRO-2, bf16, sdpa"}


def run_baselines(args, extra: list[str]) -> dict:
    """Time the requested baselines on this one GPU with the benchmark's model and batch shape."""
    cfg, _ = prepare_config(parse_args(["--model", args.model] + extra), world_size=1)
    if world_size_from_env() != 1 or not torch.cuda.is_available():
        raise ConfigError("--baselines runs on exactly one GPU (deepspeed --num_gpus 1 scripts/benchmark.py ...).")
    init_distributed(cfg.train.distributed_timeout_minutes)  # DeepSpeed (hf-zero2) needs the group of one
    shape = Shape(cfg.model, cfg.train.micro_batch_size, cfg.gradient_accumulation_steps, args.steps, args.warmup)
    results = {}
    for name in (n.strip() for n in args.baselines.split(",") if n.strip()):
        result = run_baseline(name, shape)
        result["mfu"] = result["tokens_per_sec_per_gpu"] * flops_per_token(cfg.model) / 1e12 / peak_tflops(None)
        results[name] = result
    return results


def run_benchmark(argv: list[str]) -> dict | None:
    parser = argparse.ArgumentParser(description="Benchmark a preset model through the real training path.")
    parser.add_argument("--model", default="reference")
    parser.add_argument("--steps", type=int, default=30, help="timed steps")
    parser.add_argument("--warmup", type=int, default=10, help="untimed steps before")
    parser.add_argument("--label", default=None, help="layout label for the results table (default: the extra flags)")
    parser.add_argument("--results-file", default=None, help="append one markdown row per figure here (rank 0)")
    parser.add_argument("--baselines", default="", help=f"comma list of {', '.join(BASELINES)}: also time these on one GPU "
                        "with the same shape, micro-batch and accumulation, before hybridlm's run")
    args, extra = parser.parse_known_args(argv)
    extra = [a for a in extra if a != "--"]
    baseline_results = run_baselines(args, extra) if args.baselines else {}
    # The preset goes through pretrain's own --model, so its flags come first and the extra ones win.
    flags = ["--model", args.model] + extra + ["--train-iters", str(args.warmup + args.steps), "--log-interval", "1"]
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
    for name, result in baseline_results.items():
        ratio = summary["tokens_per_sec_per_gpu"] / result["tokens_per_sec_per_gpu"]
        print(f"BASELINE {name}: {result['tokens_per_sec_per_gpu']:,.0f} tok/s/gpu | MFU {100 * result['mfu']:.1f}% | "
              f"peak {result['peak_memory_gib']:.1f} GiB | hybridlm is {ratio:.2f}x", flush=True)
    if args.results_file:
        date = datetime.date.today().isoformat()
        for name, result in baseline_results.items():
            with open(args.results_file, "a") as f:
                for figure in (f"{result['tokens_per_sec_per_gpu']:,.0f} tok/s/GPU", f"{100 * result['mfu']:.1f}% MFU",
                               f"{result['peak_memory_gib']:.1f} GiB peak",
                               f"hybridlm [{label}] = {summary['tokens_per_sec_per_gpu'] / result['tokens_per_sec_per_gpu']:.2f}x this"):
                    f.write(f"| {date} | {world}x {device_label()} | {args.model} | baseline: {BASELINE_LABELS[name]} | {figure} | `{command}` |\n")
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
