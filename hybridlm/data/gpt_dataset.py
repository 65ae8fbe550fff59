"""GPT training samples from indexed datasets: split, epochs, shuffle, blend, cache.

One prefix's documents (sequences of the ``.idx``) are split into train/valid/test ranges
(``--split 969,30,1``, Megatron's rounding). For a range, three numpy arrays define every sample:

* document index: the range's documents repeated for as many epochs as ``num_samples``
  needs, shuffled (a short final epoch is shuffled on its own so that it does not skew
  which documents come first: Megatron's 80% rule);
* sample index: where sample ``j`` starts, as (position in the document index, token
  offset); sample ``j`` is the ``seq_length + 1`` tokens from there, so consecutive samples
  share one token (labels are inputs shifted by one) and cross document boundaries;
* shuffle index: a permutation of the samples.

The arrays depend only on the data, the range, ``seq_length``, ``num_samples`` and the seed;
they are built once (by rank 0 when torch.distributed is up; the others wait at a barrier)
and stored under a hash of exactly those values, so a resumed or re-launched run maps
them back instead of rebuilding. A run resumes by asking for sample ``consumed_samples``
onward: nothing in the dataset has state.

The arrays equal Megatron-LM's ``GPTDataset`` ones for the same inputs (same RandomState
calls, same sample boundaries), computed with numpy instead of a C++ helper.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import re
from typing import Callable, Optional, Sequence

import numpy as np
import torch

from ..config import ConfigError
from .indexed import IndexedDataset

SPLITS = ("train", "valid", "test")
INDEX_ALGORITHM_VERSION = 1  # bump when the arrays below would come out differently


# ---------------------------------------------------------------- flags

def parse_split(split: str) -> list[float]:
    """'969,30,1' (or '969/30/1', '98,2') -> three fractions that sum to 1. Anything around the
    numbers is ignored, as Megatron-LM's ``re.findall(r"[.0-9]+", split)`` ignores it: a launch
    script's literal quotes (``--split '99,1,0'`` inside a bash array) read as 99,1,0."""
    text = str(split).strip().strip("'\"")
    parts = [p for p in re.split(r"[,/\s]+", text) if p]
    try:
        values = [float(p) for p in parts]
    except ValueError:
        values = []
    if not 1 <= len(values) <= 3 or any(v < 0 for v in values) or sum(values) <= 0:
        raise ConfigError(f"--split {split}: give up to three non-negative numbers for train,valid,test, such as 969,30,1.")
    values += [0.0] * (3 - len(values))
    return [v / sum(values) for v in values]


def split_ranges(fractions: Sequence[float], num_documents: int) -> list[tuple[int, int]]:
    """Document ranges per split: boundaries at round(cumulative fraction x documents), as Megatron."""
    bounds = np.concatenate([[0.0], np.cumsum(fractions)])
    edges = [int(round(b * num_documents)) for b in bounds]
    edges[-1] = num_documents
    return [(edges[i], edges[i + 1]) for i in range(3)]


def parse_data_path(data_path: Sequence[str]) -> tuple[list[str], Optional[list[float]]]:
    """``['a']`` | ``['0.3', 'a', '0.7', 'b']`` | ``['0.3 a 0.7 b']`` | ``['a', 'b']`` -> (prefixes, weights or None)."""
    if isinstance(data_path, str):
        data_path = [data_path]
    words = [w for item in data_path for w in str(item).split()]

    def number(w):
        try:
            return float(w)
        except ValueError:
            return None
    if not words:
        raise ConfigError("--data-path is empty.")
    if len(words) == 1 or all(number(w) is None for w in words):
        return words, None
    if len(words) % 2 == 0 and all(number(w) is not None for w in words[0::2]) and all(number(w) is None for w in words[1::2]):
        return words[1::2], [number(w) for w in words[0::2]]
    raise ConfigError(f"--data-path {' '.join(words)}: give prefixes alone or 'weight prefix' pairs, such as 0.3 data/a 0.7 data/b.")


# ---------------------------------------------------------------- cache

def _rank() -> tuple[bool, int]:
    on = torch.distributed.is_available() and torch.distributed.is_initialized()
    return on, (torch.distributed.get_rank() if on else 0)


def _save(path: str, array: np.ndarray) -> None:
    tmp = f"{path}.tmp{os.getpid()}.npy"
    np.save(tmp, array, allow_pickle=False)
    os.replace(tmp, path)


def cached_arrays(cache_dir: Optional[str], description: dict, names: Sequence[str],
                  build: Callable[[], Sequence[np.ndarray]]) -> tuple[np.ndarray, ...]:
    """The arrays ``build()`` returns, stored as ``.npy`` under a hash of ``description``.

    Rank 0 builds on a miss while the others wait at a barrier, then all map the files
    read-only. A rank that still finds no files (a node-local cache directory) builds its
    own copy: the result is the same, because ``build`` is deterministic. Call it on every
    rank when torch.distributed is initialised (the barrier is collective).
    """
    if cache_dir is None:
        return tuple(build())
    text = json.dumps(description, sort_keys=True)
    base = os.path.join(cache_dir, f"{description['class']}-{hashlib.sha256(text.encode()).hexdigest()[:24]}")
    paths = [f"{base}-{name}.npy" for name in names]
    marker = f"{base}-description.json"  # written last: its presence means the arrays are whole

    def build_and_save() -> None:
        try:
            os.makedirs(cache_dir, exist_ok=True)
            for path, array in zip(paths, build()):
                _save(path, np.asarray(array))
            with open(marker + f".tmp{os.getpid()}", "w") as f:
                f.write(text)
            os.replace(marker + f".tmp{os.getpid()}", marker)
        except OSError as e:
            raise ConfigError(f"cannot write the dataset index cache in {cache_dir} ({e.strerror}); choose another --data-cache-path.") from None

    def complete() -> bool:
        return os.path.isfile(marker) and all(os.path.isfile(p) for p in paths)

    distributed, rank = _rank()
    if rank == 0 and not complete():
        build_and_save()
    if distributed:
        torch.distributed.barrier()
    if not complete():
        build_and_save()
    return tuple(np.load(p, mmap_mode="r", allow_pickle=False) for p in paths)


# ---------------------------------------------------------------- indices

def _document_index(documents: np.ndarray, num_epochs: int, rng: np.random.RandomState, separate_final_epoch: bool) -> np.ndarray:
    if separate_final_epoch and num_epochs > 1:
        first = _document_index(documents, num_epochs - 1, rng, False)
        return np.concatenate([first, _document_index(documents, 1, rng, False)])
    dtype = np.int32 if len(documents) == 0 or documents[-1] < 2**31 else np.int64
    index = np.tile(documents.astype(dtype), num_epochs)
    rng.shuffle(index)
    return index


def _sample_index(sizes: np.ndarray, document_index: np.ndarray, seq_length: int, num_samples: int) -> np.ndarray:
    """(num_samples + 1, 2): sample j spans flat token positions [j*s, j*s + s] of the epoch-concatenated documents."""
    lengths = np.asarray(sizes[document_index], dtype=np.int64)
    starts = np.zeros(len(lengths), dtype=np.int64)
    np.cumsum(lengths[:-1], out=starts[1:])
    positions = np.arange(num_samples + 1, dtype=np.int64) * seq_length
    doc = np.searchsorted(starts, positions, side="right") - 1  # 'right' steps over empty documents
    doc[0] = 0  # ... except before the first sample, which Megatron starts at (0, 0) whatever its length
    offset = positions - starts[doc]
    dtype = np.int32 if max(len(document_index), int(lengths.max(initial=0))) < 2**31 else np.int64
    return np.stack([doc, offset], axis=1).astype(dtype)


def _shuffle_index(first: int, total: int, rng: np.random.RandomState) -> np.ndarray:
    dtype = np.uint32 if total < 2**32 - 1 else np.int64
    head = np.arange(first, dtype=dtype)
    rng.shuffle(head)
    if first == total:
        return head
    tail = np.arange(first, total, dtype=dtype)
    rng.shuffle(tail)
    return np.concatenate([head, tail])


def build_indices(sizes: np.ndarray, documents: np.ndarray, seq_length: int, num_samples: Optional[int],
                  seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(document_index, sample_index, shuffle_index) for ``num_samples`` samples (None: one epoch)."""
    tokens_per_epoch = int(np.asarray(sizes[documents], dtype=np.int64).sum())
    per_epoch = (tokens_per_epoch - 1) // seq_length
    num_epochs = 1 if num_samples is None else max(1, math.ceil((num_samples * seq_length + 1) / tokens_per_epoch))
    separate_final_epoch = False
    if num_epochs > 1:
        from_final_epoch = num_samples - ((num_epochs - 1) * tokens_per_epoch - 1) // seq_length
        separate_final_epoch = from_final_epoch < int(0.80 * per_epoch)
    rng = np.random.RandomState(seed)
    document_index = _document_index(documents, num_epochs, rng, separate_final_epoch)
    total = (num_epochs * tokens_per_epoch - 1) // seq_length
    sample_index = _sample_index(sizes, document_index, seq_length, total)
    sans_final = ((num_epochs - 1) * tokens_per_epoch - 1) // seq_length if separate_final_epoch else total
    return document_index, sample_index, _shuffle_index(sans_final, total, rng)


# ---------------------------------------------------------------- datasets

class SampleBatches:
    """The batch interface the trainer's ``micro_batches`` reads (the same as ``SampleStream``'s)."""

    @property
    def num_samples(self) -> int:
        return len(self)

    def batch(self, first: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        rows = torch.from_numpy(np.stack([self[first + j] for j in range(count)]).astype(np.int64))
        return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()


class GPTDataset(SampleBatches):
    """Samples of ``seq_length + 1`` tokens from documents ``[begin, end)`` of one indexed dataset."""

    def __init__(self, indexed: IndexedDataset, documents: tuple[int, int], seq_length: int, num_samples: Optional[int],
                 seed: int, cache_dir: Optional[str] = None, split: str = "train"):
        self.indexed, self.seq_length, self.split = indexed, seq_length, split
        begin, end = documents
        tokens = int(np.asarray(indexed.sequence_lengths[begin:end], dtype=np.int64).sum())
        if tokens < seq_length + 1:
            raise ConfigError(f"--data-path {indexed.prefix}: the {split} split holds {end - begin} document(s) and {tokens} "
                              f"token(s), fewer than one sample of --seq-length {seq_length} + 1; use more data or change --split.")
        if num_samples is not None and num_samples < 0:
            raise ConfigError(f"cannot draw {num_samples} samples.")
        description = {"class": "GPTDataset", **indexed.fingerprint(), "split": split, "documents": [begin, end],
                       "seq_length": seq_length, "num_samples": num_samples, "seed": seed, "algorithm": INDEX_ALGORITHM_VERSION}
        self.document_index, self.sample_index, self.shuffle_index = cached_arrays(
            cache_dir, description, ("document_index", "sample_index", "shuffle_index"),
            lambda: build_indices(indexed.sequence_lengths, np.arange(begin, end), seq_length, num_samples, seed))

    def __len__(self) -> int:
        return len(self.shuffle_index)

    def __getitem__(self, index: int) -> np.ndarray:
        if not 0 <= index < len(self):
            raise IndexError(f"sample {index} is outside the {len(self)} samples built for the {self.split} split")
        j = int(self.shuffle_index[index])
        (k0, o0), (k1, o1) = self.sample_index[j], self.sample_index[j + 1]
        docs, get = self.document_index, self.indexed.get
        if k0 == k1:
            return get(int(docs[k0]), int(o0), int(o1 - o0 + 1)).astype(np.int64)
        parts = [get(int(docs[k0]), int(o0))] + [get(int(docs[k])) for k in range(k0 + 1, k1)] + [get(int(docs[k1]), 0, int(o1) + 1)]
        return np.concatenate(parts).astype(np.int64)


def default_cache_dir(prefix: str) -> str:
    return os.path.join(os.path.dirname(os.path.abspath(prefix)), "index-cache")


def build_gpt_datasets(data_path: Sequence[str], split: str, seq_length: int, seed: int,
                       num_samples: Sequence[Optional[int]], cache_dir: Optional[str] = None, documents=None) -> tuple:
    """(train, valid, test) datasets over ``--data-path`` (one prefix, or weighted prefixes blended),
    or over ``documents`` (an in-memory stand-in for one prefix: ``mock.MockDocuments``).

    ``num_samples[i]`` is how many samples split i must provide (for training:
    train_iters x global_batch_size); 0 or a zero split fraction gives None, and None gives one
    epoch. Index caches go to ``cache_dir`` (default: ``index-cache/`` beside each prefix; none for
    ``documents`` without one). Call on every rank: the first build is collective when
    torch.distributed is initialised.
    """
    fractions = parse_split(split)
    if len(num_samples) != 3:
        raise ConfigError(f"num_samples must give train, valid and test counts, got {num_samples}.")
    if documents is not None:
        prefixes, weights, indexed, caches = [documents.prefix], None, [documents], [cache_dir]
    else:
        prefixes, weights = parse_data_path(data_path)
        indexed = [IndexedDataset(p) for p in prefixes]
        caches = [cache_dir or default_cache_dir(p) for p in prefixes]
    ranges = [split_ranges(fractions, len(d)) for d in indexed]
    result = []
    for s, name in enumerate(SPLITS):
        n = num_samples[s]
        if fractions[s] == 0 or n == 0:
            result.append(None)
        elif len(prefixes) == 1:
            result.append(GPTDataset(indexed[0], ranges[0][s], seq_length, n, seed, caches[0], name))
        else:
            parts = [(d, r[s], c) for d, r, c in zip(indexed, ranges, caches)]
            result.append(_blend(parts, weights, n, seq_length, seed, name))
    return tuple(result)


def _blend(parts, weights: Optional[Sequence[float]], n: Optional[int], seq_length: int, seed: int, split: str):
    """A BlendedDataset over (indexed, document range, cache dir) parts; weights default to token counts."""
    from .blending import BlendedDataset, cached_blending_indices, normalize_weights
    tokens = [int(np.asarray(d.sequence_lengths[b:e], dtype=np.int64).sum()) for d, (b, e), _ in parts]
    w = normalize_weights(weights if weights is not None else tokens)
    if n is None:  # the largest blend in which no dataset repeats
        n = min(int(max(0, (t - 1) // seq_length) / wi) for t, wi in zip(tokens, w) if wi > 0)
        if n < 1:
            raise ConfigError(f"--data-path: the {split} split of some prefix holds fewer than --seq-length {seq_length} + 1 tokens.")
    dataset_index, sample_index = cached_blending_indices(w, n, parts[0][2])
    counts = np.bincount(dataset_index, minlength=len(parts))
    datasets = [GPTDataset(d, r, seq_length, int(c), seed, cache, split) if c else None
                for (d, r, cache), c in zip(parts, counts)]
    return BlendedDataset(datasets, dataset_index, sample_index)
