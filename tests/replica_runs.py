"""A training run in which one rank's copy of the weights is nudged after a given iteration: what
``--check-weight-hash-across-dp-replicas-interval`` must catch. Run in-process by the CPU tests (forked gloo
ranks) and launched on GPUs:

    torchrun --nproc_per_node 2 tests/replica_runs.py --nudge-at 4 --nudge-rank 1 -- <scripts/pretrain.py flags>
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def nudge_after(iteration: int, rank: int, expert: bool = False) -> None:
    """From now on in this process: after the step that reaches ``iteration``, global rank ``rank`` adds 1e-2 to
    the first element of its first dense (or, with ``expert``, expert) parameter, as a faulty GPU might."""
    import torch
    import torch.distributed as dist

    from hybridlm.training import trainer
    step = trainer.train_step

    def step_then_nudge(run, batches):
        loss = step(run, batches)
        if run.iteration == iteration and dist.get_rank() == rank:
            for param in run.engine.module.parameters():
                if (getattr(param, "allreduce", True) is False) == expert and param.numel():
                    with torch.no_grad():
                        param.view(-1)[0] += 1e-2
                    break
        return loss

    trainer.train_step = step_then_nudge


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--nudge-at", type=int, required=True)
    parser.add_argument("--nudge-rank", type=int, required=True)
    parser.add_argument("--expert", action="store_true")
    args, flags = parser.parse_known_args()
    nudge_after(args.nudge_at, args.nudge_rank, args.expert)
    from hybridlm.training.trainer import main as train
    return train(flags[1:] if flags[:1] == ["--"] else flags)


if __name__ == "__main__":
    sys.exit(main())
