"""Fine-tuning rows from ``preprocess_chat`` output: SFT rows (one sample each, or packed) and DPO pairs.

A sample of L tokens t_0..t_{L-1} with mask m becomes L - 1 row positions: inputs t_0..t_{L-2},
labels t_1..t_{L-1} where m is 1 and ``IGNORE_INDEX`` elsewhere, positions 0..L-2. So no sample
predicts another's first token, and a row of ``seq_length`` positions holds a sample of up to
``seq_length + 1`` tokens (longer ones keep their start). Unused positions at a row's end are
padding: token ``pad``, label ignored, positions counting from 0 again (a sample of their own,
which no real token attends to).

``--packing`` fills each row with several samples: every epoch's samples (shuffled by the seed)
are packed best-fit-decreasing (each into the fullest row it still fits), and the epoch's rows
shuffled. Rows then carry their position ids, which tell the model where each sample begins.
Everything is a function of the data, ``seq_length`` and the seed: every layout reads the same
rows, so a parallel run computes the single-process function.

Rows and pairs are read through ``batch(first, count)``, the interface ``samples.micro_batches``
reads pretraining samples through: item ``i`` of the infinite stream is item ``i mod n`` of epoch
``i // n``.
"""
from __future__ import annotations

import json
import os
from typing import Optional

import numpy as np
import torch

from ..config import ConfigError
from ..model.attention_backends import sample_starts
from ..parallel.tensor_parallel import IGNORE_INDEX
from .chat_preprocess import MANIFEST_FORMAT, manifest_path, mask_prefix
from .indexed import IndexedDataset


def read_manifest(prefix: str) -> dict:
    path = manifest_path(prefix)
    if not os.path.isfile(path):
        raise ConfigError(f"--data-path {prefix}: no {os.path.basename(path)} beside it; fine-tuning data comes from "
                          "scripts/preprocess_chat.py (pretraining data from preprocess_data.py has no loss mask).")
    with open(path) as f:
        manifest = json.load(f)
    if manifest.get("format") != MANIFEST_FORMAT:
        raise ConfigError(f"{path} is not a preprocess_chat.py manifest.")
    return manifest


class ChatData:
    """The token and mask datasets of one ``preprocess_chat`` prefix."""

    def __init__(self, prefix: str):
        self.prefix, self.manifest = prefix, read_manifest(prefix)
        self.tokens, self.mask = IndexedDataset(prefix), IndexedDataset(mask_prefix(prefix))
        if len(self.tokens) != len(self.mask) or not np.array_equal(self.tokens.sequence_lengths, self.mask.sequence_lengths):
            raise ConfigError(f"--data-path {prefix}: the token and mask datasets do not describe the same documents.")
        self.kind = self.manifest["kind"]

    @property
    def lengths(self) -> np.ndarray:
        return np.asarray(self.tokens.sequence_lengths, dtype=np.int64)

    def sample(self, index: int, limit: int) -> tuple[np.ndarray, np.ndarray]:
        """(ids, mask) of document ``index``, at most ``limit`` tokens."""
        length = min(int(self.tokens.sequence_lengths[index]), limit)
        return (self.tokens.get(index, 0, length).astype(np.int64), self.mask.get(index, 0, length).astype(bool))


def place(row: int, offset: int, ids: np.ndarray, mask: np.ndarray, tokens, labels, positions) -> int:
    """Write one sample at ``offset`` of row ``row``; returns the positions it took."""
    n = len(ids) - 1
    tokens[row, offset:offset + n] = ids[:-1]
    labels[row, offset:offset + n] = np.where(mask[1:], ids[1:], IGNORE_INDEX)
    positions[row, offset:offset + n] = np.arange(n)
    return n


def empty_rows(count: int, seq_length: int, pad: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    tokens = np.full((count, seq_length), pad, dtype=np.int64)
    labels = np.full((count, seq_length), IGNORE_INDEX, dtype=np.int64)
    positions = np.tile(np.arange(seq_length, dtype=np.int64), (count, 1))
    return tokens, labels, positions


class _RowsBySpace:
    """Open rows grouped by their free space, with a count tree over the spaces: the row with the
    least free space that still fits an item is found in O(log capacity), whatever the row count."""

    def __init__(self, capacity: int):
        self.leaves = 1 << capacity.bit_length()  # > capacity
        self.counts = [0] * (2 * self.leaves)
        self.rows: list[list[int]] = [[] for _ in range(capacity + 1)]

    def _count(self, space: int, change: int) -> None:
        node = space + self.leaves
        while node:
            self.counts[node] += change
            node //= 2

    def put(self, space: int, row: int) -> None:
        self.rows[space].append(row)
        self._count(space, 1)

    def take(self, at_least: int) -> tuple[int, int] | None:
        """(space, row) of a row with the least free space >= ``at_least``, removed; None if there is none."""
        node = at_least + self.leaves
        if not self.counts[node]:
            while node > 1 and not (node % 2 == 0 and self.counts[node + 1]):
                node //= 2
            if node == 1:
                return None
            node += 1
            while node < self.leaves:  # down to the smallest space under this subtree
                node = 2 * node if self.counts[2 * node] else 2 * node + 1
        space = node - self.leaves
        self._count(space, -1)
        return space, self.rows[space].pop()


def pack_best_fit(sizes: np.ndarray, capacity: int) -> list[list[int]]:
    """Items (indices into ``sizes``, each at most ``capacity``) in rows of at most ``capacity``,
    best fit decreasing: each item, largest first, goes to the row it fills most closely."""
    rows: list[list[int]] = []
    open_rows = _RowsBySpace(capacity)
    for item in np.argsort(-sizes, kind="stable"):
        size = int(sizes[item])
        found = open_rows.take(size)
        space, row = found if found is not None else (capacity, len(rows))
        if found is None:
            rows.append([])
        rows[row].append(int(item))
        if space > size:
            open_rows.put(space - size, row)
    return rows


class SFTRows:
    """Rows of ``seq_length`` positions from a supervised ``ChatData``; ``batch`` gives
    (tokens, labels), or ((tokens, position ids), labels) with ``packing``."""

    def __init__(self, data: ChatData, seq_length: int, seed: int, pad: int, packing: bool):
        if data.kind != "sft":
            raise ConfigError(f"--data-path {data.prefix} holds preference pairs; train them with --task dpo.")
        self.data, self.seq_length, self.seed, self.pad, self.packing = data, seq_length, seed, pad, packing
        lengths = data.lengths
        self.usable = np.flatnonzero(lengths >= 2)  # a sample of one token has no label
        self.truncated = int((lengths > seq_length + 1).sum())
        self.sizes = np.minimum(lengths, seq_length + 1) - 1  # positions each sample takes
        self._epochs: list[list[list[int]]] = []  # epoch -> rows -> document ids

    def _epoch(self, epoch: int) -> list[list[int]]:
        while len(self._epochs) <= epoch:
            rng = np.random.RandomState((self.seed + len(self._epochs)) % 2**32)
            order = self.usable[rng.permutation(len(self.usable))]
            if self.packing:
                rows = [[int(order[i]) for i in row] for row in pack_best_fit(self.sizes[order], self.seq_length)]
                rows = [rows[i] for i in rng.permutation(len(rows))]
            else:
                rows = [[int(d)] for d in order]
            self._epochs.append(rows)
        return self._epochs[epoch]

    def row(self, index: int) -> list[int]:
        """The documents in row ``index`` of the stream."""
        per_epoch = len(self._epoch(0))
        return self._epoch(index // per_epoch)[index % per_epoch]

    def batch(self, first: int, count: int):
        tokens, labels, positions = empty_rows(count, self.seq_length, self.pad)
        for r in range(count):
            offset = 0
            for doc in self.row(first + r):
                ids, mask = self.data.sample(doc, self.seq_length + 1)
                offset += place(r, offset, ids, mask, tokens, labels, positions)
        tokens, labels, positions = (torch.from_numpy(a) for a in (tokens, labels, positions))
        if not self.packing:
            return tokens, labels
        sample_starts(positions)  # found here, on the host, they travel with the ids (samples.to_device)
        return (tokens, positions), labels


class DPOPairs:
    """Preference pairs from a preference ``ChatData``: ``batch(first, count)`` gives the rows of
    ``count`` pairs, chosen rows first, then rejected rows, and labels (labels, pair ids)."""

    def __init__(self, data: ChatData, seq_length: int, seed: int, pad: int, shuffle: bool = True):
        if data.kind != "preference":
            raise ConfigError(f"--data-path {data.prefix} holds supervised conversations; train them with --task sft.")
        longest_prompt = data.manifest.get("max_prompt_tokens") or 0
        if longest_prompt > seq_length:
            raise ConfigError(f"--data-path {data.prefix} has a prompt of {longest_prompt} tokens, longer than --seq-length "
                              f"{seq_length} leaves room for (a reply needs at least one position); raise --seq-length or "
                              "preprocess with a --seq-length that refuses such pairs.")
        self.data, self.seq_length, self.seed, self.pad, self.shuffle = data, seq_length, seed, pad, shuffle
        self.num_pairs = len(data.tokens) // 2
        self.truncated = int((data.lengths > seq_length + 1).sum())
        self._orders: dict[int, np.ndarray] = {}

    def pair(self, index: int) -> int:
        epoch, at = divmod(index, self.num_pairs)
        if not self.shuffle:
            return at
        if epoch not in self._orders:
            self._orders = {epoch: np.random.RandomState((self.seed + epoch) % 2**32).permutation(self.num_pairs)}
        return int(self._orders[epoch][at])

    def batch(self, first: int, count: int):
        tokens, labels, positions = empty_rows(2 * count, self.seq_length, self.pad)
        pairs = [self.pair(first + j) for j in range(count)]
        for j, pair in enumerate(pairs):
            for side in (0, 1):
                ids, mask = self.data.sample(2 * pair + side, self.seq_length + 1)
                place(side * count + j, 0, ids, mask, tokens, labels, positions)
        return torch.from_numpy(tokens), (torch.from_numpy(labels), torch.tensor(pairs, dtype=torch.int64))


def check_tokenizer(data: ChatData, tokenizer_type: str, tokenizer_path: Optional[str]) -> None:
    """The data was tokenized by the tokenizer this run names (same encoding files)."""
    from .chat_template import encoding_sha256
    source = data.manifest["tokenizer"]["path"]
    if tokenizer_type != "HuggingFaceTokenizer" or tokenizer_path is None:
        raise ConfigError(f"--data-path {data.prefix} was tokenized by {source}; name it with --tokenizer-type HuggingFaceTokenizer "
                          f"--tokenizer-model {source} (or --load a checkpoint imported with it).")
    if not os.path.exists(tokenizer_path):
        raise ConfigError(f"--tokenizer-model {tokenizer_path}: no such file or directory.")
    want = data.manifest["tokenizer"]["sha256"]
    if encoding_sha256(tokenizer_path) != want:
        raise ConfigError(f"--data-path {data.prefix} was tokenized by {source}, whose files differ "
                          f"from --tokenizer-model {tokenizer_path}; preprocess the data again with this run's tokenizer.")
