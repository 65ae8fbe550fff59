"""Time a named model and layout: N steps after warm-up, medians of the per-step figures.

hybridlm's steps are timed by the trainer's own log records (log interval 1, so each record
is one step, closed by a device synchronisation through ``loss.item()``); the first
``warmup`` steps (allocator growth, autotuning, JIT) are dropped. ``--system`` times one of
the peers of ``baselines.py`` instead (the same model as plain PyTorch, compiled or not, or
Hugging Face + DeepSpeed ZeRO-2, with the same shape, micro-batch and accumulation), and
``--baselines`` times peers first and prints hybridlm's ratio to each.

``--record-file`` appends one JSON line per timed run (rank 0): the figures, the per-step
throughputs, the model flags and the command. The benchmark suite (``python -m benchmarks``)
runs this script for its cases and renders its tables from those records.
"""
from __future__ import annotations

import argparse
import datetime
import json
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

SYSTEMS = ("hybridlm",) + BASELINES


def device_label(name: str | None = None) -> str:
    """A GPU's short name ("H200"), of this process's GPU or of ``name``; "CPU" without one."""
    if name is None and torch.cuda.is_available():
        name = torch.cuda.get_device_name()
    if name is None:
        return "CPU"
    return next((short for short in ("H200", "H100", "A100", "L40S") if short in name), name)


def time_peer(name: str, model_args: list[str], steps: int, warmup: int) -> dict:
    """One peer of baselines.py on this one GPU, with the benchmark's model and batch shape."""
    cfg, _ = prepare_config(parse_args(model_args), world_size=1)
    if world_size_from_env() != 1 or not torch.cuda.is_available():
        raise ConfigError(f"--system/--baselines {name} runs on exactly one GPU (deepspeed --num_gpus 1 scripts/benchmark.py ...).")
    if not dist.is_initialized():
        init_distributed(cfg.train.distributed_timeout_minutes)  # DeepSpeed (hf-zero2) needs the group of one
    shape = Shape(cfg.model, cfg.train.micro_batch_size, cfg.gradient_accumulation_steps, steps, warmup)
    result = run_baseline(name, shape)
    per_token = flops_per_token(cfg.model)
    peak = peak_tflops(cfg.train.peak_tflops)
    steps_tps = result["step_tokens_per_sec"]
    tflops = statistics.median(steps_tps) * per_token / 1e12
    return {"system": name, "tokens_per_sec_per_gpu": statistics.median(steps_tps), "tflops_per_gpu": tflops,
            "mfu": tflops / peak if peak else None, "peak_tflops": peak, "flops_per_token": per_token,
            "peak_memory_gib": result["peak_memory_gib"], "step_tokens_per_sec_per_gpu": steps_tps,
            "final_loss": result["final_loss"], "world_size": 1}


def time_hybridlm(model_args: list[str], steps: int, warmup: int) -> dict | None:
    """hybridlm through pretrain(); None on ranks other than 0."""
    # A preset's warm-up (tiny: 20 steps) can outlast a short timed run, which the schedule refuses;
    # the learning rate does not change a step's cost, so no warm-up unless the flags ask for one.
    flags = ["--lr-warmup-iters", "0"] + model_args + ["--train-iters", str(warmup + steps), "--log-interval", "1"]
    logged = pretrain(flags)
    if dist.is_initialized() and dist.get_rank() != 0:
        return None
    timed = logged[warmup:]
    tps = statistics.median(r["tokens_per_sec_per_gpu"] for r in timed)
    tflops = statistics.median(r["tflops_per_gpu"] for r in timed)
    return {"system": "hybridlm", "tokens_per_sec_per_gpu": tps, "tflops_per_gpu": tflops,
            "mfu": statistics.median(r["mfu"] for r in timed) if timed[0]["mfu"] is not None else None,
            "peak_tflops": tflops / timed[0]["mfu"] if timed[0]["mfu"] else None,
            "flops_per_token": timed[0]["tflops_per_gpu"] * 1e12 / timed[0]["tokens_per_sec_per_gpu"],
            "peak_memory_gib": max((r["max_memory_gib"] for r in timed if "max_memory_gib" in r), default=None),
            "step_tokens_per_sec_per_gpu": [r["tokens_per_sec_per_gpu"] for r in timed],
            "final_loss": timed[-1]["loss"], "world_size": dist.get_world_size() if dist.is_initialized() else 1}


def shown_command(argv: list[str], world: int) -> str:
    """The command as a user types it: the launcher adds --local_rank itself; the record file is plumbing."""
    shown = [a for i, a in enumerate(argv) if a != "--record-file" and not a.startswith("--local_rank")
             and (i == 0 or argv[i - 1] != "--record-file")]
    return f"deepspeed --num_gpus {world} scripts/benchmark.py " + shlex.join(shown)


def summary_line(record: dict) -> str:
    mfu = f"MFU {100 * record['mfu']:.1f}% | " if record["mfu"] is not None else ""
    peak = f"peak {record['peak_memory_gib']:.1f} GiB | " if record["peak_memory_gib"] is not None else ""
    return (f"{record['tokens_per_sec_per_gpu']:,.0f} tok/s/gpu | {record['tflops_per_gpu']:.1f} TFLOP/s/gpu | {mfu}{peak}"
            f"loss {record['final_loss']:.3f}")


def run_benchmark(argv: list[str]) -> list[dict] | None:
    """Time what the flags ask for; returns the records (rank 0) or None (other ranks)."""
    parser = argparse.ArgumentParser(description="Benchmark a preset model through the real training path, or a peer.")
    parser.add_argument("--model", default="reference")
    parser.add_argument("--steps", type=int, default=30, help="timed steps")
    parser.add_argument("--warmup", type=int, default=10, help="untimed steps before")
    parser.add_argument("--label", default=None, help="layout label for the tables (default: the extra flags)")
    parser.add_argument("--system", default="hybridlm", choices=SYSTEMS,
                        help="what to time: hybridlm, or one peer of hybridlm/training/baselines.py alone (one GPU)")
    parser.add_argument("--baselines", default="", help=f"comma list of {', '.join(BASELINES)}: also time these on one GPU "
                        "with the same shape, micro-batch and accumulation, before hybridlm's run")
    parser.add_argument("--record-file", default=None, help="append one JSON line per timed run here (rank 0)")
    args, extra = parser.parse_known_args(argv)
    extra = [a for a in extra if a != "--" and not a.startswith("--local_rank")]
    model_args = ["--model", args.model] + extra  # the preset first, so the extra flags win
    peers = [n.strip() for n in args.baselines.split(",") if n.strip()]
    unknown = [n for n in peers if n not in BASELINES]
    if unknown:
        raise ConfigError(f"--baselines: unknown baseline {unknown[0]!r} (have: {', '.join(BASELINES)}).")
    results = [time_peer(name, model_args, args.steps, args.warmup) for name in peers]
    main = (time_hybridlm(model_args, args.steps, args.warmup) if args.system == "hybridlm"
            else time_peer(args.system, model_args, args.steps, args.warmup))
    if main is None:
        return None
    results.append(main)
    label = args.label or (" ".join(extra) or "default")
    now = datetime.datetime.now()
    common = {"model": args.model, "model_args": model_args, "label": label, "device": f"{main['world_size']}x {device_label()}",
              "steps": args.steps, "warmup": args.warmup, "command": shown_command(argv, main["world_size"]),
              "date": now.date().isoformat(), "time": now.isoformat(timespec="seconds")}
    records = [{**common, **r} for r in results]
    print(f"\nBENCH {args.system} {args.model} [{label}] on {device_label()}: {summary_line(main)}", flush=True)
    for peer in records[:-1]:
        print(f"BASELINE {peer['system']}: {summary_line(peer)} | hybridlm is "
              f"{main['tokens_per_sec_per_gpu'] / peer['tokens_per_sec_per_gpu']:.2f}x", flush=True)
    if args.record_file:
        with open(args.record_file, "a") as f:
            for record in records:
                f.write(json.dumps(record) + "\n")
    return records


def main() -> int:
    try:
        run_benchmark(sys.argv[1:])
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    return 0
