"""Where a job's start-up goes: the seconds from the process's start to its training loop, by phase.

At scale a job's set-up (imports, process groups, building and placing the model, DeepSpeed's engine, a checkpoint's
load) costs minutes of every GPU in the allocation, and a restart pays it again; Megatron-LM prints its "time to
initialize" for that reason. ``SetupClock`` times the phases ``build_run`` goes through, and ``line`` says them in one
sentence on rank 0, with the time the interpreter spent before the job began (Python's start and the imports).
"""
from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Optional

import psutil


class SetupClock:
    """Seconds per named phase, in the order they ran; a phase entered twice adds up."""

    def __init__(self) -> None:
        self.phases: dict[str, float] = {}
        self.began = time.time()  # the job's start (pretrain's call), on the clock the process's start is read from

    @contextmanager
    def phase(self, name: str):
        started = time.perf_counter()
        try:
            yield
        finally:
            self.phases[name] = self.phases.get(name, 0.0) + time.perf_counter() - started

    def before_the_job(self) -> Optional[float]:
        """Seconds from the process's start to the job's (the interpreter and the imports), if the system says."""
        try:
            return max(0.0, self.began - psutil.Process().create_time())
        except (psutil.Error, OSError):
            return None

    def line(self) -> str:
        """'set-up 14.2 s: imports 4.1, flags 0.3, process groups 1.0, model 2.2, ...' (phases of 0.05 s or more)."""
        before = self.before_the_job()
        parts = ([("imports", before)] if before is not None else []) + list(self.phases.items())
        total = sum(seconds for _, seconds in parts)
        shown = ", ".join(f"{name} {seconds:.1f}" for name, seconds in parts if seconds >= 0.05)
        return f"set-up {total:.1f} s: {shown} (seconds)"
