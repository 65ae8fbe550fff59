"""Training with the monitor on, keeping each rank's sampled steps for the GPU tests (tests/test_monitor_gpu.py):

    torchrun --nproc_per_node 2 tests/monitor_runs.py --out DIR -- <scripts/pretrain.py flags with --log-comm-interval N>

Each rank writes DIR/rank<r>.json: its analysed samples (the split by group and by collective, the shares), each beside
the profiler's own total of NCCL kernel time in the same profile (torch's parsed events, not the exported trace the
monitor reads); rank 0 also the logged records.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def collective_clues(events: list, groups) -> dict:
    """What a failed assertion needs to say why a kernel landed in a group: the run's group map, and for the first
    few NCCL kernels of the exported trace their name, their own arguments and what the monitor joined them to."""
    from hybridlm.training.timeline import _CollectiveFinder
    find = _CollectiveFinder(events)
    kernels = [e for e in events if e.get("cat") == "kernel" and "nccl" in e.get("name", "").lower()]
    return {"group_names": groups.names, "group_ranks": {str(k): v for k, v in groups.ranks.items()},
            "nccl_kernels": len(kernels),
            "record_param_comms": sum(1 for e in events if e.get("name") == "record_param_comms"),
            "first": [{"name": k["name"][:80], "args": {a: str(v)[:60] for a, v in k.get("args", {}).items()},
                       "joined": {a: str(v)[:60] for a, v in find(k).items()}} for k in kernels[:3]]}


def keep_samples(samples: list) -> None:
    """From now on in this process: every analysed sample is also appended to ``samples``."""
    from hybridlm.training import monitor
    take, analyse = monitor.CommSampler.take, monitor.analyse
    clues: dict = {}

    def analyse_and_note(events, groups, *args, **kwargs):
        clues.update(collective_clues(events, groups))
        return analyse(events, groups, *args, **kwargs)

    def take_and_keep(self):
        session = self.pending[0]
        # the collective kernels alone: a GPU-side user annotation ("nccl:all_reduce") spans its kernel again
        own_us = sum(e.time_range.elapsed_us() for e in session.events()
                     if e.device_type.name == "CUDA" and "nccl" in e.name.lower() and not getattr(e, "is_user_annotation", False))
        clues.clear()
        step, iteration, spent = take(self)
        samples.append({"iteration": iteration, "profiler_nccl_ms": own_us / 1e3, "clues": dict(clues),
                        **(dataclasses.asdict(step) if step is not None else {})})
        return step, iteration, spent

    monitor.CommSampler.take = take_and_keep
    monitor.analyse = analyse_and_note


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args, flags = parser.parse_known_args()
    samples: list = []
    keep_samples(samples)
    import torch.distributed as dist

    from hybridlm.training.trainer import pretrain
    records = pretrain(flags[1:] if flags[:1] == ["--"] else flags)
    rank = dist.get_rank()
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
        json.dump({"samples": samples, "records": records if rank == 0 else []}, f)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
