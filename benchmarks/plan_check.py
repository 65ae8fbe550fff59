"""The memory planner against a measured run: one layout, every rank's peak, the prediction beside it.

    torchrun --nproc_per_node 2 benchmarks/plan_check.py --label "DP2 ZeRO-1" -- [pretrain flags]   # CPU
    deepspeed --num_gpus 2 benchmarks/plan_check.py --label "TP2" -- --bf16 [pretrain flags]        # GPU

Each rank runs the real training (``hybridlm.training.trainer.pretrain``) inside
``hybridlm.planner.measure.PeakMemory`` (CUDA: ``max_memory_allocated``; CPU: the allocator's
records under ``torch.profiler``); rank 0 prints the worst rank's peak, the planner's estimate
for the same flags (``hybridlm.planner.fit.planned_peak``) and their ratio, and appends one record
to ``--record-file``. ``--reduce-bucket-size N`` runs with a copy of the DeepSpeed JSON whose
gradient buckets hold N elements (the shipped 5e8 would otherwise dominate small CPU models).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _small_bucket_json(path: str, elements: int) -> str:
    with open(path) as f:
        ds = json.load(f)
    zero = ds.setdefault("zero_optimization", {})
    for key in ("reduce_bucket_size", "allgather_bucket_size"):
        zero[key] = elements
    fd, out = tempfile.mkstemp(prefix="plan_check_", suffix=".json")
    with os.fdopen(fd, "w") as f:
        json.dump(ds, f)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--label", required=True, help="the layout's name in the record (the tables' configuration column)")
    parser.add_argument("--record-file", default=None, help="append one JSON record here (rank 0; the benchmark suite's)")
    parser.add_argument("--reduce-bucket-size", type=int, default=None, help="gradient bucket elements (default: the JSON's)")
    args, flags = parser.parse_known_args()
    flags = [f for f in flags if f != "--"]
    flags = [f for f in flags if not f.startswith("--local_rank")]

    import torch
    import torch.distributed as dist

    from benchmarks.records import append, script_record
    from hybridlm.config import parse_args
    from hybridlm.planner.fit import planned_peak
    from hybridlm.planner.measure import PeakMemory
    from hybridlm.planner.memory import GIB
    from hybridlm.training.trainer import prepare_config, pretrain

    run_flags, bucket_json = list(flags), None
    if args.reduce_bucket_size:
        bucket_json = _small_bucket_json(parse_args(flags).train.deepspeed_config, args.reduce_bucket_size)
        run_flags += ["--deepspeed_config", bucket_json]
    cfg, ds = prepare_config(parse_args(run_flags))
    predicted = planned_peak(cfg, ds, "cuda" if torch.cuda.is_available() else "cpu")

    with PeakMemory() as peak:
        pretrain(run_flags)
    if bucket_json:
        os.unlink(bucket_json)
    peaks = [None] * dist.get_world_size()
    dist.all_gather_object(peaks, peak.bytes)
    if dist.get_rank() == 0:
        worst = max(peaks)
        ratio = predicted.total / worst
        world = dist.get_world_size()
        device = (f"{world}x {torch.cuda.get_device_name()}" if torch.cuda.is_available()
                  else f"CPU ({os.cpu_count()} cores), {world} rank{'s' if world > 1 else ''}")
        parts = ", ".join(f"{k} {v:.2f}" for k, v in predicted.gib().items() if k != "total" and v)
        print(f"PLAN {args.label}: measured {worst / GIB:.3f} GiB (ranks: {', '.join(f'{p / GIB:.3f}' for p in peaks)}) | "
              f"planner {predicted.total / GIB:.3f} GiB ({parts}; stage {predicted.stage}) | planner/measured {ratio:.3f}",
              flush=True)
        if args.record_file:
            launcher = (f"torchrun --nproc_per_node {world}" if "TORCHELASTIC_RUN_ID" in os.environ  # set by torchrun only
                        else f"deepspeed --num_gpus {world}")
            model = cfg.model.model or (f"d{cfg.model.hidden_size} L{cfg.model.num_layers} "
                                        f"seq {cfg.model.seq_length} vocab {cfg.model.vocab_size}")
            append(args.record_file, script_record(
                f"{launcher} benchmarks/plan_check.py", [a for a in sys.argv[1:] if not a.startswith("--local_rank")],
                args.label, {"measured GiB": f"{worst / GIB:.3f}", "planner GiB": f"{predicted.total / GIB:.3f}",
                             "planner vs measured": f"{100 * (ratio - 1):+.1f}%"}, model=model, device=device))
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
