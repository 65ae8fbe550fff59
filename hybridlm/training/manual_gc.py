"""``--manual-gc``: Python's garbage collector at chosen steps instead of at allocation counts.

A full collection walks every tracked Python object (module trees, compiled-graph wrappers,
autograd bookkeeping) on the thread that launches the GPU's work: tens of milliseconds in
which the GPU may starve, at a moment that differs from rank to rank, so in a synchronous
job one rank's pause becomes every rank's. As Megatron-LM's flags of the same names: the
automatic collector is off, and a collection runs every ``--manual-gc-interval`` steps
(0: never between steps) and around evaluation, at the same iteration on every rank.
"""
from __future__ import annotations

import gc


class ManualGC:
    def __init__(self, enabled: bool, interval: int):
        self.enabled, self.interval = enabled, interval
        if enabled:
            gc.disable()
            gc.collect()  # start from a clean heap: what set-up left behind

    def after_step(self, iteration: int) -> None:
        if self.enabled and self.interval and iteration % self.interval == 0:
            gc.collect()

    def collect(self) -> None:
        """Around evaluation, where a pause costs no training time."""
        if self.enabled:
            gc.collect()

    def close(self) -> None:
        if self.enabled:
            gc.enable()
