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


def keep_samples(samples: list) -> None:
    """From now on in this process: every analysed sample is also appended to ``samples``."""
    from hybridlm.training import monitor
    take = monitor.CommSampler.take

    def take_and_keep(self):
        session = self.pending[0]
        # the collective kernels alone: a GPU-side user annotation ("nccl:all_reduce") spans its kernel again
        own_us = sum(e.time_range.elapsed_us() for e in session.events()
                     if e.device_type.name == "CUDA" and "nccl" in e.name.lower() and not getattr(e, "is_user_annotation", False))
        step, iteration, spent = take(self)
        samples.append({"iteration": iteration, "profiler_nccl_ms": own_us / 1e3,
                        **(dataclasses.asdict(step) if step is not None else {})})
        return step, iteration, spent

    monitor.CommSampler.take = take_and_keep


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
