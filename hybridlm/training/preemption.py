"""Stop cleanly when the scheduler says time is nearly up, so the job can be requeued.

Slurm sends a signal some time before the end of an allocation (``#SBATCH
--signal=USR1@120``) or on request (``scancel --signal=USR1 JOB``). With
``--exit-signal-handler`` the trainer notes it, finishes the step it is in, and asks every
rank at the end of each step whether any of them got it (one all-reduce of a single flag:
the signal may reach one rank or all of them, and at slightly different steps). When one
did, all ranks save a checkpoint together and the job exits with ``EXIT_CODE``; the sbatch
templates turn that code into ``scontrol requeue``, and the requeued job resumes from the
checkpoint through ``--load``.
"""
from __future__ import annotations

import signal

import torch
import torch.distributed as dist

# sysexits.h EX_TEMPFAIL: "a temporary failure; the user is invited to retry".
EXIT_CODE = 75


class Preempted(RuntimeError):
    """The run saved a checkpoint and stopped early because of the exit signal."""


class ExitSignal:
    """Records that ``signum`` arrived; ``agreed()`` tells every rank whether any rank got it."""

    def __init__(self, name: str):
        self.name = name
        self.signum = getattr(signal, name)
        self.received = False
        self._previous = signal.signal(self.signum, self._note)

    def _note(self, signum, frame) -> None:
        self.received = True  # only a flag: the step in flight finishes undisturbed

    def agreed(self, device) -> bool:
        """True on every rank when any rank has received the signal (a collective: all ranks call it)."""
        flag = torch.tensor([1.0 if self.received else 0.0], device=device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def restore(self) -> None:
        signal.signal(self.signum, self._previous)
