"""Weighted blending of datasets with exact proportions (Megatron's greedy blending index).

Sample ``n`` of the blend comes from the dataset whose share so far lags its weight the
most: ``argmax_i (w_i * max(n, 1) - taken_i)``, ties to the lower index. After any number
of samples each dataset has contributed its weight's share to within one sample, and the
order depends only on the weights and the size, so every rank computes the same blend.
This is the loop of ``build_blending_indices`` in Megatron-LM's ``helpers.cpp``, written
in Python: it costs about a second per few million samples, once, and is cached on disk.
"""
from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

from ..config import ConfigError
from .gpt_dataset import SampleBatches, cached_arrays


def normalize_weights(weights: Sequence[float]) -> list[float]:
    w = [float(x) for x in weights]
    if any(x < 0 or x != x for x in w) or sum(w) <= 0:
        raise ConfigError(f"--data-path weights {w} must be non-negative and not all zero.")
    total = sum(w)
    return [x / total for x in w]


def blending_indices(weights: Sequence[float], size: int) -> tuple[np.ndarray, np.ndarray]:
    """(dataset_index int16, dataset_sample_index int64), each of length ``size``."""
    w = normalize_weights(weights)
    taken = [0] * len(w)
    dataset_index = np.empty(size, dtype=np.int16)
    sample_index = np.empty(size, dtype=np.int64)
    pairs = list(enumerate(w))
    for n in range(size):
        x = float(max(n, 1))
        best, best_error = 0, w[0] * x - taken[0]
        for i, wi in pairs[1:]:
            error = wi * x - taken[i]
            if error > best_error:
                best, best_error = i, error
        dataset_index[n] = best
        sample_index[n] = taken[best]
        taken[best] += 1
    return dataset_index, sample_index


class BlendedDataset(SampleBatches):
    """Sample ``i`` is sample ``dataset_sample_index[i]`` of dataset ``dataset_index[i]``."""

    def __init__(self, datasets: Sequence, dataset_index: np.ndarray, dataset_sample_index: np.ndarray):
        self.datasets, self.dataset_index, self.dataset_sample_index = list(datasets), dataset_index, dataset_sample_index
        counts = np.bincount(dataset_index, minlength=len(self.datasets))
        for i, (d, c) in enumerate(zip(self.datasets, counts)):
            if c and (d is None or len(d) < c):
                raise ValueError(f"blend component {i} has {0 if d is None else len(d)} samples but the blend needs {c}")

    def __len__(self) -> int:
        return len(self.dataset_index)

    def __getitem__(self, index: int) -> np.ndarray:
        if not 0 <= index < len(self):
            raise IndexError(f"sample {index} is outside the blend's {len(self)} samples")
        return self.datasets[self.dataset_index[index]][int(self.dataset_sample_index[index])]


def cached_blending_indices(weights: Sequence[float], size: int, cache_dir: Optional[str]) -> tuple[np.ndarray, np.ndarray]:
    """``blending_indices`` built once (by rank 0) and kept under a key of the weights and size."""
    w = normalize_weights(weights)
    description = {"class": "BlendedDataset", "weights": w, "size": size, "algorithm": 1}
    return cached_arrays(cache_dir, description, ("dataset_index", "dataset_sample_index"), lambda: blending_indices(w, size))
