"""``--profile-step-range A,B``: a torch.profiler trace of a few chosen training iterations.

Profiling every step would slow the whole run and write gigabytes, and the first steps are
unrepresentative (allocator warm-up, DeepSpeed bucket set-up), so the user names a window.
``StepProfiler.step(iteration)`` is called after each optimizer step with the number of
steps completed: the profiler starts when that number reaches A and stops when it reaches
B, so the trace holds iterations A+1 .. B, each under a ``ProfilerStep#<iteration>``
marker. Every rank writes its own ``trace_rank{r}_steps{A}-{B}.json`` (open it in
Perfetto or chrome://tracing): pipeline stages and TP ranks do different work.
"""
from __future__ import annotations

import os
from typing import Optional

import torch
from torch.profiler import ProfilerActivity, profile

from ..config import ConfigError


class StepProfiler:
    """Starts and stops one torch.profiler session around a window of training iterations."""

    def __init__(self, step_range: Optional[str], output_dir: str, rank: int):
        self.range = self.parse(step_range)
        self.output_dir, self.rank = output_dir, rank
        self._profile: Optional[profile] = None

    @staticmethod
    def parse(step_range: Optional[str]) -> Optional[tuple[int, int]]:
        """"A,B" -> (A, B); None -> None. Call it during config validation to fail early."""
        if step_range is None:
            return None
        error = ConfigError(f"--profile-step-range {step_range!r} must be two integers A,B with 0 <= A < B, e.g. 10,12.")
        try:
            start, stop = (int(part) for part in step_range.split(","))
        except ValueError:
            raise error from None
        if not 0 <= start < stop:
            raise error
        return start, stop

    @property
    def trace_path(self) -> str:
        start, stop = self.range
        return os.path.join(self.output_dir, f"trace_rank{self.rank}_steps{start}-{stop}.json")

    def step(self, iteration: int) -> Optional[str]:
        """Call once before the loop and once after every iteration; returns the trace path when one is written.

        The call before the loop (with the starting iteration) is what lets A=0, or A equal to
        a resumed run's first iteration, start the profiler before the first profiled step.
        """
        if self.range is None:
            return None
        start, stop = self.range
        if self._profile is None:
            if iteration == start:
                self._start(iteration)
        elif iteration >= stop:
            return self.close()
        else:
            self._profile.step()
        return None

    def close(self) -> Optional[str]:
        """Stop and export if still profiling (the run ended inside the window); returns the trace path.

        The trace then ends with an empty marker for the iteration that never ran.
        """
        if self._profile is None:
            return None
        self._profile.stop()
        os.makedirs(self.output_dir, exist_ok=True)
        self._profile.export_chrome_trace(self.trace_path)
        self._profile = None
        return self.trace_path

    def _start(self, iteration: int) -> None:
        activities = [ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(ProfilerActivity.CUDA)
        # A schedule that always records only exists to make the profiler mark steps;
        # numbering them by training iteration makes the trace match the log lines.
        self._profile = profile(activities=activities, record_shapes=True, with_stack=False,
                                schedule=lambda _: torch.profiler.ProfilerAction.RECORD)
        self._profile.step_num = iteration + 1
        self._profile.start()
