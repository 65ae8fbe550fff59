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
import time

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
        return any_rank(self.received, device)

    def restore(self) -> None:
        signal.signal(self.signum, self._previous)


def any_rank(flag: bool, device) -> bool:
    """True on every rank when ``flag`` holds on any rank (a collective: all ranks call it)."""
    value = torch.tensor([1.0 if flag else 0.0], device=device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return bool(value.item())


class EarlyExit:
    """Whether to save and stop before ``--train-iters``, asked at the end of every step (the
    same step on every rank): the exit signal (the job is requeued: ``Preempted``), or, as in
    Megatron-LM's training loop, ``--exit-duration-in-mins`` since the process started and
    ``--exit-interval`` (the run simply ends, exit code 0)."""

    def __init__(self, train_config, started: float):
        t = train_config
        self.signal = ExitSignal(t.exit_signal) if t.exit_signal_handler else None
        self.minutes, self.interval, self.started = t.exit_duration_in_mins, t.exit_interval, started

    def reason(self, iteration: int, device) -> str | None:
        """Why to stop after ``iteration``, or None; collective when a signal or a duration is watched."""
        if self.signal is not None and self.signal.agreed(device):
            return "signal"
        if self.minutes is not None and any_rank((time.monotonic() - self.started) / 60 > self.minutes, device):
            return f"trained for more than --exit-duration-in-mins {self.minutes:g}"
        if self.interval and iteration % self.interval == 0:
            return f"iteration {iteration} is a multiple of --exit-interval {self.interval}"
        return None

    def restore(self) -> None:
        if self.signal is not None:
            self.signal.restore()
