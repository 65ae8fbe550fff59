"""Fixed-length training samples from a token stream, split over data-parallel ranks.

Sample ``i`` is the window ``tokens[i*s : i*s + s + 1]`` (inputs and shifted labels) of a
seeded permutation, re-drawn each epoch. The global batch of step ``t`` is samples
``[t*G, (t+1)*G)``; micro-step ``m`` of DP rank ``r`` takes the ``r``-th of the DP slices of
its chunk. Every layout therefore sees exactly the same samples in each step, which is
what lets a parallel run equal the single-process run, and the position to resume from
is simply ``consumed_samples = t*G``.
"""
from __future__ import annotations

from typing import Iterator

import numpy as np
import torch


class SampleStream:
    def __init__(self, tokens: np.ndarray, seq_length: int, seed: int):
        self.tokens, self.seq_length, self.seed = tokens, seq_length, seed
        self.num_samples = (len(tokens) - 1) // seq_length
        if self.num_samples < 1:
            raise ValueError(f"the corpus has {len(tokens)} tokens, fewer than one sample of --seq-length {seq_length} + 1")
        self._epoch, self._order = -1, None

    def _permutation(self, epoch: int) -> np.ndarray:
        if epoch != self._epoch:
            self._order = np.random.default_rng([self.seed, epoch]).permutation(self.num_samples)
            self._epoch = epoch
        return self._order

    def sample(self, index: int) -> np.ndarray:
        epoch, within = divmod(index, self.num_samples)
        start = int(self._permutation(epoch)[within]) * self.seq_length
        return self.tokens[start:start + self.seq_length + 1]

    def batch(self, first: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        rows = torch.from_numpy(np.stack([self.sample(first + j) for j in range(count)]).astype(np.int64))
        return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()


def micro_batches(stream: SampleStream, *, micro_batch_size: int, global_batch_size: int, dp_rank: int, dp_size: int,
                  start_iteration: int = 0, device=None) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """(tokens, labels) micro-batches for one DP rank, forever, from ``start_iteration`` on."""
    per_micro_step = micro_batch_size * dp_size
    accumulation = global_batch_size // per_micro_step
    iteration = start_iteration
    while True:
        for m in range(accumulation):
            first = iteration * global_batch_size + m * per_micro_step + dp_rank * micro_batch_size
            tokens, labels = stream.batch(first, micro_batch_size)
            yield tokens.to(device), labels.to(device)
        iteration += 1
