"""Samples split over data-parallel ranks.

``stream`` is any dataset with ``batch(first, count) -> (tokens, labels)`` (a GPTDataset or a
blend of them: sample ``i`` is already shuffled, deterministically for the seed). The
global batch of step ``t`` is samples
``[t*G, (t+1)*G)``; micro-step ``m`` of DP rank ``r`` takes the ``r``-th of the DP slices of
its chunk. Every layout therefore sees exactly the same samples in each step, which is
what lets a parallel run equal the single-process run, and the position to resume from
is simply ``consumed_samples = t*G``. Under context parallelism each CP rank of a DP rank
reads the same samples and keeps its slice of each sequence: this is the one place a
sample is sliced (``context_slice``: tokens, labels and position ids alike, in
``hybridlm.parallel.context``'s load-balanced layout that attention and the loss assume). The
rows' positions travel with them then (``with_positions``), sliced like the rest: RoPE rotates
each token by the position the batch gives it, and knows nothing of the layout.
"""
from __future__ import annotations

from typing import Iterator

import torch

from ..model.attention_backends import SAMPLE_STARTS, attach_sample_starts
from ..parallel.context import slice_for_rank


def micro_batches(stream, *, micro_batch_size: int, global_batch_size: int, dp_rank: int, dp_size: int,
                  start_iteration: int = 0, device=None, cp_rank: int = 0, cp_size: int = 1) -> Iterator[tuple]:
    """(inputs, labels) micro-batches for one DP rank (and CP rank), forever, from ``start_iteration`` on
    (each a tensor, or for fine-tuning a tuple of tensors: tokens and position ids, labels and what the
    loss needs), cut to the CP rank's slice of the sequence (``context_slice``)."""
    per_micro_step = micro_batch_size * dp_size
    accumulation = global_batch_size // per_micro_step
    iteration = start_iteration
    while True:
        for m in range(accumulation):
            first = iteration * global_batch_size + m * per_micro_step + dp_rank * micro_batch_size
            inputs, labels = stream.batch(first, micro_batch_size)
            inputs = context_slice(with_positions(inputs, cp_size), cp_rank, cp_size)
            labels = context_slice(labels, cp_rank, cp_size)
            yield to_device(inputs, device), to_device(labels, device)
        iteration += 1


def with_positions(inputs, cp_size: int):
    """Tokens [rows, sequence] -> (tokens, their positions 0..s-1 in every row) under context
    parallelism, where a rank keeps a slice of each row and RoPE needs the slice's place in it;
    rows that carry position ids already (packed samples), and any row without CP, as they are."""
    if cp_size == 1 or isinstance(inputs, tuple):
        return inputs
    return inputs, torch.arange(inputs.shape[1]).expand(inputs.shape[0], -1)


def context_slice(t, cp_rank: int, cp_size: int):
    """CP rank ``cp_rank``'s part of a batch (a tensor or a tuple of them): every [rows, sequence]
    tensor (tokens, labels with their ignored positions, position ids) cut to the rank's load-balanced
    slice of the sequence, the same positions in each; per-row values ([rows]: DPO's pair ids) whole."""
    if isinstance(t, tuple):
        return tuple(context_slice(x, cp_rank, cp_size) for x in t)
    return slice_for_rank(t, 1, cp_rank, cp_size) if t.dim() >= 2 else t


def to_device(t, device):
    """A tensor, or each tensor of a tuple, on ``device`` (see ``tensor_to_device``)."""
    if isinstance(t, tuple):
        return tuple(to_device(x, device) for x in t)
    return tensor_to_device(t, device)


def tensor_to_device(t: torch.Tensor, device) -> torch.Tensor:
    """Copy a host batch to ``device`` without waiting for it.

    A copy from ordinary (pageable) host memory waits for everything the GPU has queued (the
    previous micro-batch's backward) and blocks the host meanwhile: a full synchronisation per
    micro-batch, after which the GPU idles while the host launches the next forward's first
    kernels. From pinned memory the copy is queued behind that work like a kernel (the FP8
    reference model on one H200: 114,981 vs 111,134 tok/s, benchmarks/RESULTS.md). Packed
    position ids take their host-computed sample starts along (``attention_backends.sample_starts``),
    which the model would otherwise find with a read-back of its own."""
    if device is None or torch.device(device).type != "cuda":
        return t.to(device)
    out = t.pin_memory().to(device, non_blocking=True)
    starts = getattr(t, SAMPLE_STARTS, None)  # packed position ids: their sample starts go along
    if starts is not None:
        attach_sample_starts(out, tensor_to_device(starts, device))
    return out
