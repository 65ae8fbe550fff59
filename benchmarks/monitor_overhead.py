"""What the training monitor costs (README, "Monitoring"): the reference model on one GPU with the headline's flags,
trained once without the monitor and once with it, in the same call.

    python3 benchmarks/monitor_overhead.py [--steps 24 --warmup 6 --interval 5] [--record-file R.jsonl] [--out DIR]
    python3 benchmarks/monitor_overhead.py --tiny       (a check of the script on a CPU: the tiny model, gloo)

The two runs (each a process of its own, through the deepspeed launcher, --log-interval 1 so each logged record is
one step, timed after ``--warmup`` steps):

- off: the flags of the headline case ref-bf16 (bf16, ZeRO-1, --torch-compile, cuDNN attention, gbs 64);
- on: the same with --log-grad-noise-scale and --log-comm-interval ``--interval``, so several timed steps are sampled.

Figures: the median step of each run; the noise scale's cost per step (the on-run's unsampled steps against the
off-run); a sampled step's cost (its step time over the on-run's median unsampled step, plus the export and analysis
the monitor logs as comm_sample_overhead_ms, which the step clock leaves out); and from them the overhead at the Slurm
templates' --log-comm-interval 500 and at 100, without and with the noise scale. The first sample (in the warm-up)
also starts the profiler's CUDA tracing; its extra cost is given apart.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks.records import append, script_record  # noqa: E402
from benchmarks.runner import free_port, gpu_choice  # noqa: E402

HEADLINE = ["--model", "reference", "--bf16", "--deepspeed_config", "ds_configs/zero1.json", "--torch-compile",
            "--global-batch-size", "64", "--attention-backend", "cudnn"]
TINY = ["--model", "tiny", "--deepspeed_config", "ds_configs/zero0.json", "--micro-batch-size", "2",
        "--global-batch-size", "8"]
SLURM_INTERVAL = 500  # slurm/*.sbatch


def train(flags: list[str], metrics: str, log: str, tiny: bool) -> list[dict]:
    """One run through the deepspeed launcher on one device; its logged training records."""
    # a free rendezvous port: the launcher's default may be held by another job
    head = [shutil.which("deepspeed") or "deepspeed", *gpu_choice(1), "--master_port", str(free_port())]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if tiny:
        env.update(DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    if os.path.exists(metrics):
        os.remove(metrics)
    with open(log, "w") as out:
        code = subprocess.run(head + ["scripts/pretrain.py", *flags, "--metrics-file", metrics], cwd=ROOT, env=env,
                              stdout=out, stderr=subprocess.STDOUT).returncode
    if code != 0:
        raise RuntimeError(f"the run failed (exit {code}); its log: {log}")
    with open(metrics) as f:
        return [r for r in map(json.loads, f) if "loss" in r]


def figures(off: list[dict], on: list[dict], warmup: int) -> dict:
    """Milliseconds per step and the overheads, from the two runs' per-step records."""
    timed_off = [1e3 * r["step_seconds"] for r in off[warmup:]]
    timed_on = on[warmup:]
    sampled = [r for r in timed_on if "comm_sampled_iteration" in r]
    unsampled = [1e3 * r["step_seconds"] for r in timed_on if "comm_sampled_iteration" not in r]
    step_off, step_on = statistics.median(timed_off), statistics.median(unsampled)
    sample_costs = [1e3 * r["step_seconds"] - step_on + r["comm_sample_overhead_ms"] for r in sampled]
    sample_ms = statistics.mean(sample_costs)
    first = next((r for r in on[:warmup] if "comm_sampled_iteration" in r), None)
    noise_share = (step_on - step_off) / step_off
    result = {"step ms (monitor off)": step_off, "step ms (noise scale on, unsampled)": step_on,
              "noise scale cost per step": noise_share, "sampled step cost ms": sample_ms,
              "sampled steps": len(sampled),
              "exposed comm share": statistics.mean(r["exposed_comm_share"] for r in sampled
                                                    if r.get("exposed_comm_share") is not None) if sampled and
              any(r.get("exposed_comm_share") is not None for r in sampled) else None,
              "GPU busy share": statistics.mean(r["gpu_busy_share"] for r in sampled if r.get("gpu_busy_share") is not None)
              if any(r.get("gpu_busy_share") is not None for r in sampled) else None}
    for interval in (SLURM_INTERVAL, 100):
        comm = sample_ms / (interval * step_off)
        result[f"overhead at --log-comm-interval {interval}"] = comm
        result[f"overhead at --log-comm-interval {interval} with the noise scale"] = comm + noise_share
    if first is not None:
        result["first sample's extra ms (profiler start-up)"] = (1e3 * first["step_seconds"] - step_on
                                                                 + first["comm_sample_overhead_ms"] - sample_ms)
    return result


def shown(name: str, value) -> str:
    if value is None:
        return "n/a"
    if "overhead" in name or "cost per step" in name or "share" in name:
        return f"{100 * value:.2f}%"
    return f"{value:,.1f}" if isinstance(value, float) else str(value)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=24, help="timed steps of each run")
    parser.add_argument("--warmup", type=int, default=6, help="untimed steps before them")
    parser.add_argument("--interval", type=int, default=5, help="--log-comm-interval of the monitored run")
    parser.add_argument("--tiny", action="store_true", help="the tiny model on a CPU (checks the script)")
    parser.add_argument("--out", default="/tmp/monitor-overhead", help="folder for the runs' metrics and logs")
    parser.add_argument("--record-file", default=None, help="append one JSON record (the benchmark suite's)")
    args = parser.parse_args(argv)
    if not 1 <= args.interval <= args.steps:
        parser.error(f"--interval {args.interval} must be between 1 and --steps {args.steps}: some timed steps must be sampled.")
    os.makedirs(args.out, exist_ok=True)
    base = (TINY if args.tiny else HEADLINE) + ["--train-iters", str(args.warmup + args.steps), "--log-interval", "1",
                                               "--lr-warmup-iters", "0"]
    monitored = base + ["--log-grad-noise-scale", "--log-comm-interval", str(args.interval)]
    runs = {}
    for name, flags in (("off", base), ("on", monitored)):
        runs[name] = train(flags, os.path.join(args.out, f"{name}.jsonl"), os.path.join(args.out, f"{name}.log"), args.tiny)
    result = figures(runs["off"], runs["on"], args.warmup)
    for name, value in result.items():
        print(f"{name:58s} {shown(name, value)}")
    if args.record_file:
        label = ("tiny model, 1 CPU rank" if args.tiny else "the reference on 1 GPU, ref-bf16's flags") + \
                f": monitor off, then --log-grad-noise-scale --log-comm-interval {args.interval}"
        append(args.record_file, script_record("python benchmarks/monitor_overhead.py", argv, label,
                                               {k: shown(k, v) for k, v in result.items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
