"""``--mock-data``: Megatron-LM's synthetic documents, for runs that measure speed, not learning.

Megatron-LM's ``MockGPTLowLevelDataset`` (megatron/core/datasets/gpt_dataset.py): 100,000
documents whose lengths are drawn once from ``numpy.random.default_rng(0).integers(1, 4096)``;
document ``i`` of length ``n`` is the tokens ``1, 2, ..., n - 1`` (modulo the vocabulary) and the
tokenizer's end-of-document id. ``MockGPTDataset`` then splits, shuffles and cuts them into
samples as it does real documents, which ``gpt_dataset.GPTDataset`` does here with the same
arrays, so a mock run sees Megatron's samples.
"""
from __future__ import annotations

from typing import Optional

import numpy as np


class MockDocuments:
    """The documents of Megatron's mock dataset, read like an ``IndexedDataset``."""

    seed, size, max_sequence_length = 0, 100_000, 4096  # Megatron's hard-coded values
    prefix = "--mock-data"

    def __init__(self, vocab_size: int, eod: int):
        self.vocab_size, self.eod = vocab_size, eod
        rng = np.random.default_rng(seed=self.seed)
        self.sequence_lengths = rng.integers(low=1, high=self.max_sequence_length, size=self.size, dtype=np.int32)

    def __len__(self) -> int:
        return self.size

    def fingerprint(self) -> dict:
        return {"mock": [self.seed, self.size, self.max_sequence_length], "vocab_size": self.vocab_size, "eod": self.eod}

    def get(self, index: int, offset: int = 0, length: Optional[int] = None) -> np.ndarray:
        n = int(self.sequence_lengths[index])
        document = np.concatenate([(np.arange(n - 1, dtype=np.int64) + 1) % self.vocab_size, [self.eod]])
        end = n if length is None else offset + length
        return document[offset:end]
