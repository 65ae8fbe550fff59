"""The fixed-shape state of one batched decode, and its decode step captured as CUDA graphs.

Why: a decode step of a small model is a thousand small kernels (about 48 a layer), each costing the
host more than the GPU; and attention over a cache that grows by one column a step gives cuDNN's SDPA a
new shape, so a new execution plan, every step (the profile of issue 42: 4.7 ms of host time per layer
per token, at 3.3 ms of GPU work per token for the whole model). Here every tensor a step touches has
a shape fixed for the whole decode: the cache is allocated to its final length, each row's valid
length lives on the device, and attention reads the whole cache under a mask built from those lengths.
A step is then the same launches every time, so it is captured once per batch size and replayed: one
graph launch per token (two with sampling: the noise is drawn outside, from the caller's generator).

Rows that finish early stop costing: every ``check_every`` tokens the host reads how many rows are still
decoding, and when they fit a smaller power of two the live rows move to the front (their caches
too) and the step of that smaller batch runs from then on (captured when first needed).

The graphs read the weights where they lie, so they live only for one ``generate_batch`` call (the
training step that follows moves and updates weights; ZeRO-3 gathers them anew for each rollout).
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

# what a step reads and writes besides the caches; restored after the warm-up run that precedes a capture
_STEP_BUFFERS = ("tokens", "lengths", "finished", "slots", "step", "produced", "ended")


class DecodeState:
    """Buffers of a decode of ``rows`` rows (slot ``i`` holds row ``slots[i]``; a row past ``rows`` is a
    bin for the slots of no row) with caches of ``length`` columns; see the module's docstring."""

    def __init__(self, rows: int, length: int, max_new_tokens: int, cache, pad_id: int, noise_width: int, device):
        self.rows, self.length, self.cache, self.pad_id = rows, length, cache, pad_id
        long = dict(dtype=torch.long, device=device)
        self.tokens = torch.full((rows,), pad_id, **long)  # the token each slot feeds next
        self.lengths = torch.zeros(rows, **long)  # the column (= position) that token takes
        self.finished = torch.zeros(rows, dtype=torch.bool, device=device)
        self.slots = torch.arange(rows, **long)
        self.slot_ids = torch.arange(rows, **long)  # 0, 1, ...: each slot's index, for indexing its cache row
        self.step = torch.zeros((), **long)
        self.out = torch.full((rows + 1, max_new_tokens), pad_id, **long)  # by row; the last row is the bin
        self.produced = torch.full((rows + 1,), max_new_tokens, **long)
        self.ended = torch.zeros(rows + 1, dtype=torch.bool, device=device)  # stopped by a stop token
        self.columns = torch.arange(length, **long)
        self.noise = torch.empty(rows, noise_width, dtype=torch.float32, device=device) if noise_width else None
        self.rope: Optional[tuple] = None  # cos, sin [length, head_dim] of every column, with RoPE

    def mask(self, batch: int, dtype) -> torch.Tensor:
        """Additive attention mask [batch, 1, 1, length]: each slot sees its columns up to its current token."""
        seen = self.columns.unsqueeze(0) <= self.lengths[:batch].unsqueeze(1)
        zero = torch.zeros((), dtype=dtype, device=seen.device)
        return torch.where(seen, zero, torch.finfo(dtype).min)[:, None, None, :]

    def live(self, batch: int) -> int:
        """How many of the first ``batch`` slots still decode (a host sync)."""
        return int((~self.finished[:batch]).sum())

    def compact(self, batch: int, smaller: int) -> None:
        """Move the live slots among the first ``batch`` to the front; slots up to ``smaller`` after them decode nothing."""
        keep = (~self.finished[:batch]).nonzero().squeeze(1)
        n = keep.numel()
        for tensor in self.cache.keys + self.cache.values:
            tensor[:n] = tensor[keep]
        for name in ("tokens", "lengths", "slots"):
            buffer = getattr(self, name)
            buffer[:n] = buffer[keep]
        self.finished[:n] = False
        self.finished[n:smaller] = True
        self.tokens[n:smaller] = self.pad_id
        self.lengths[n:smaller] = 0
        self.slots[n:smaller] = self.rows

    def saved(self) -> dict:
        return {name: getattr(self, name).clone() for name in _STEP_BUFFERS}

    def restore(self, saved: dict) -> None:
        for name, value in saved.items():
            getattr(self, name).copy_(value)


def bucket(live: int) -> int:
    """The batch size a decode of ``live`` rows continues at: the next power of two."""
    return 1 << max(live - 1, 0).bit_length()


class StepRunner:
    """Runs ``step(batch)`` (one decode step of the first ``batch`` slots, all on the device): replayed
    from a CUDA graph per batch size when ``graphs``, else called."""

    def __init__(self, step: Callable[[int], None], state: DecodeState, graphs: bool):
        self.step, self.state, self.graphs = step, state, graphs
        self.captured: dict[int, torch.cuda.CUDAGraph] = {}
        self.pool = torch.cuda.graph_pool_handle() if graphs else None

    def __call__(self, batch: int) -> None:
        if not self.graphs:
            self.step(batch)
            return
        if batch not in self.captured:
            self.captured[batch] = self._capture(batch)
        self.captured[batch].replay()

    def _capture(self, batch: int) -> torch.cuda.CUDAGraph:
        """Warm up once on a side stream (cuBLAS and cuDNN choose their kernels), undo what that step
        wrote, and record the step. The warm-up's cache columns are the ones the real step rewrites."""
        saved = self.state.saved()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self.step(batch)
        torch.cuda.current_stream().wait_stream(side)
        self.state.restore(saved)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            self.step(batch)
        return graph

    def release(self) -> None:
        self.captured.clear()


def use_graphs(model: torch.nn.Module, device: torch.device, requested: Optional[bool]) -> bool:
    """CUDA graphs on a GPU unless the caller says otherwise, and never for MoE layers (their routing sizes
    the experts' batches on the host)."""
    if device.type != "cuda" or requested is False:
        return False
    from .gpt import MoEMLP
    return not any(isinstance(m, MoEMLP) for m in model.modules())
