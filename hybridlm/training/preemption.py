"""Stop cleanly when the scheduler says time is nearly up, so the job can be requeued.

Slurm sends a signal some time before the end of an allocation (``#SBATCH
--signal=USR1@120``) or on request (``scancel --signal=USR1 JOB``). With
``--exit-signal-handler`` the trainer notes it, finishes the step it is in, and asks every
rank at the end of each step whether any of them got it (one all-reduce of a single flag:
the signal may reach one rank or all of them, and at slightly different steps). When one
did, all ranks save a checkpoint together and the job exits with ``EXIT_CODE``; the sbatch
templates turn that code into ``scontrol requeue``, and the requeued job resumes from the
checkpoint through ``--load``.

Without that flag, a run with ``--save`` treats SIGINT (Ctrl-C) and SIGTERM the same way (``StopSignals``),
except that it exits 128 + the signal's number after saving, as a process stopped by it would: a launcher
(``deepspeed``, ``torchrun``, ``srun``) passes them on to the ranks, or a terminal sends them to every
process, and then gives the ranks some seconds (DeepSpeed's and torchrun's 30, Slurm's KillWait) before
it kills them. The wait for the step in flight is bounded (``STOP_GRACE_SECONDS``), and a second
Ctrl-C (a second after the first at least: ``REPEAT_WINDOW_SECONDS``) stops at once, without saving.
"""
from __future__ import annotations

import os
import signal
import sys
import threading
import time

import torch
import torch.distributed as dist

# sysexits.h EX_TEMPFAIL: "a temporary failure; the user is invited to retry".
EXIT_CODE = 75
# After a stop signal a rank that has not begun the save within this many seconds (a step that long, a collective
# stuck on a dead rank) exits without saving: a stop never turns into a hang.
STOP_GRACE_SECONDS = 120.0
# One Ctrl-C can reach a rank twice: from the terminal (the whole process group gets it) and again from torchrun's
# agent, which passes the signal it got on to its workers milliseconds later. The same signal again within this many
# seconds of the first is that copy, not a second press (which would exit without saving); a person pressing
# Ctrl-C again after it is heard.
REPEAT_WINDOW_SECONDS = 1.0


class Preempted(RuntimeError):
    """The run saved a checkpoint and stopped early because of the exit signal."""


class Interrupted(RuntimeError):
    """The run saved a checkpoint and stopped because of SIGINT or SIGTERM; ``exit_code`` is 128 + its number."""

    def __init__(self, message: str, signum: int):
        super().__init__(message)
        self.exit_code = 128 + signum


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


class StopSignals:
    """SIGINT and SIGTERM (those that are not the --exit-signal): noted, so that the step in flight finishes and every
    rank saves (``agreed``); a second of the same signal (``repeat_window`` seconds or more after the first), or ``grace``
    seconds without reaching the save, exits at once. ``received`` is the first signal this rank handled: under the
    deepspeed launcher a rank gets the terminal's SIGINT and the launcher's SIGTERM together, in either order."""

    def __init__(self, names, grace: float = STOP_GRACE_SECONDS, repeat_window: float = REPEAT_WINDOW_SECONDS):
        self.received: str | None = None
        self.grace, self.repeat_window = grace, repeat_window
        self._timer = None
        self._received_at = 0.0
        self._previous = {getattr(signal, name): signal.signal(getattr(signal, name), self._note) for name in names}

    def _note(self, signum, frame) -> None:
        name = signal.Signals(signum).name
        if self.received == name and time.monotonic() - self._received_at >= self.repeat_window:
            _exit_now(f"hybridlm: a second {name}: stopping at once, without saving.", signum)  # pressed twice
        if self.received is None:
            self.received, self._received_at = name, time.monotonic()
            self._timer = threading.Timer(self.grace, _exit_now, (f"hybridlm: {name} received, but no step ended within "
                                                                   f"{self.grace:g} s to save at: stopping without saving.", signum))
            self._timer.daemon = True
            self._timer.start()

    def agreed(self, device) -> str | None:
        """The signal's name on every rank when any rank has received one (a collective: all ranks call it)."""
        code = torch.tensor([signal.Signals[self.received].value if self.received else 0], device=device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(code, op=dist.ReduceOp.MAX)
        return signal.Signals(int(code.item())).name if code.item() else None

    def saving(self) -> None:
        """The save has begun: its own time is bounded by the collectives' timeout, not by the grace."""
        if self._timer is not None:
            self._timer.cancel()

    def restore(self) -> None:
        self.saving()
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)


def _exit_now(line: str, signum: int) -> None:
    print(line, file=sys.stderr, flush=True)
    os._exit(128 + signum)


class EarlyExit:
    """Whether to save and stop before ``--train-iters``, asked at the end of every step (the
    same step on every rank): the exit signal (the job is requeued: ``Preempted``), or, as in
    Megatron-LM's training loop, ``--exit-duration-in-mins`` since the process started and
    ``--exit-interval`` (the run simply ends, exit code 0)."""

    def __init__(self, train_config, started: float):
        t = train_config
        self.signal = ExitSignal(t.exit_signal) if t.exit_signal_handler else None
        stops = [name for name in ("SIGINT", "SIGTERM") if not (t.exit_signal_handler and name == t.exit_signal)]
        self.stops = StopSignals(stops) if t.save and stops else None
        self.minutes, self.interval, self.started = t.exit_duration_in_mins, t.exit_interval, started
        self.stopped_by: str | None = None  # SIGINT or SIGTERM, once the ranks agreed to stop on it

    def reason(self, iteration: int, device) -> str | None:
        """Why to stop after ``iteration``, or None; collective when a signal or a duration is watched."""
        if self.signal is not None and self.signal.agreed(device):
            return "signal"
        if self.stops is not None:
            self.stopped_by = self.stops.agreed(device)
            if self.stopped_by:
                self.stops.saving()
                return self.stopped_by
        if self.minutes is not None and any_rank((time.monotonic() - self.started) / 60 > self.minutes, device):
            return f"trained for more than --exit-duration-in-mins {self.minutes:g}"
        if self.interval and iteration % self.interval == 0:
            return f"iteration {iteration} is a multiple of --exit-interval {self.interval}"
        return None

    def saving(self) -> None:
        """The final save begins: a stop signal from here on waits for it (no grace timer)."""
        if self.stops is not None:
            self.stops.saving()

    def restore(self) -> None:
        if self.signal is not None:
            self.signal.restore()
        if self.stops is not None:
            self.stops.restore()
