"""Measured peak memory of a real training run, to hold the planner's figures against.

On a GPU the measure is ``torch.cuda.max_memory_allocated()``: bytes in live tensors at the
worst moment, without the caching allocator's reserve or NCCL's own buffers. On a CPU torch
keeps no such counter, so the run is wrapped in ``torch.profiler`` with ``profile_memory``:
every allocation and free of the CPU allocator (the one every CPU tensor comes from, DeepSpeed's
included) is recorded with its size, and the peak of their running sum is the same quantity,
peak bytes in live tensors since the profiler started (before the model is built). Peak RSS
would be a worse measure: it counts the Python interpreter and libraries (~1 GB here), pages
that the allocator holds after a free, and misses allocations never touched (``torch.empty``).
"""
from __future__ import annotations

import contextlib

import torch


class PeakMemory:
    """``with PeakMemory() as peak: ...`` then ``peak.bytes``: the peak of live tensor bytes on
    this process's device (CUDA) or in the CPU allocator (CPU), counted from the start of the block."""

    def __init__(self):
        self.bytes = 0
        self._profiler = None
        self._cuda = torch.cuda.is_available()

    def __enter__(self) -> "PeakMemory":
        if self._cuda:
            torch.cuda.synchronize()
            self._base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        else:
            from torch.profiler import ProfilerActivity, profile
            self._profiler = profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=False)
            self._profiler.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self._cuda:
            torch.cuda.synchronize()
            self.bytes = torch.cuda.max_memory_allocated() - self._base
            return
        with contextlib.redirect_stdout(None):
            self._profiler.__exit__(*exc)
        self.bytes = cpu_peak_from_profile(self._profiler)


def cpu_peak_from_profile(prof) -> int:
    """Peak of the running sum of the CPU allocator's records (allocations positive, frees negative)."""
    records = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                     if e.name() == "[memory]" and str(e.device_type()).endswith("CPU"))
    live = peak = 0
    for _, delta in records:
        live += delta
        peak = max(peak, live)
    return peak
