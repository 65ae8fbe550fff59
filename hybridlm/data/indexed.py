"""Megatron-LM's memory-mapped indexed dataset (``.bin`` + ``.idx``), read and written byte for byte.

A dataset is a prefix ``P`` naming two files. ``P.bin`` is every token of every sequence,
back to back, in one dtype. ``P.idx`` says where each sequence starts:

    offset  size     field
    0       9        b"MMIDIDX\\x00\\x00"
    9       8        version, uint64 little-endian, always 1
    17      1        dtype code, uint8 (DTYPE_CODES below)
    18      8        S = number of sequences, uint64
    26      8        D = number of entries in the document index, uint64 (documents + 1)
    34      4*S      sequence lengths in tokens, int32
    ..      8*S      sequence pointers: byte offset of each sequence in P.bin, int64
    ..      8*D      document index: sequence number where each document starts, int64,
                     starting at 0 and ending at S
    ..      1*S      (optional) sequence modes, int8: written by Megatron for multimodal data

This is what ``megatron/core/datasets/indexed_dataset.py`` (and the older Megatron-LM and
Megatron-DeepSpeed ``MMapIndexedDataset``) write and read, so data preprocessed by either
tool loads in the other. One document here is one sequence (no sentence splitting).

Writing goes to temporary names and is renamed into place at the end, ``.idx`` last, so an
interrupted run never leaves a pair that looks whole; the reader checks that the ``.idx``
is complete and that the ``.bin`` has exactly the size it describes, and says so in one
sentence otherwise.

Given the tokenizer's flags, the writer also leaves ``P.ids.json`` beside the pair: the largest
token id written and the tokenizer that wrote it, so that a run can tell at start-up, without
reading the corpus, that its vocabulary is too small for the data (Megatron ignores the file;
for data without one a sample of documents is read instead).
"""
from __future__ import annotations

import json
import os
import struct
from typing import Optional

import numpy as np

from ..config import ConfigError

HEADER = b"MMIDIDX\x00\x00"
VERSION = 1
_FIXED = len(HEADER) + 8 + 1 + 8 + 8  # 34 bytes before the arrays

# Megatron's DType enum: code -> numpy dtype.
DTYPE_CODES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64, 7: np.float32, 8: np.uint16}
_CODE_OF = {np.dtype(t): c for c, t in DTYPE_CODES.items()}


class IndexedDataError(ConfigError):
    """A .bin/.idx pair that is missing, truncated, foreign or inconsistent."""


def optimal_dtype(vocab_size: int) -> type:
    """uint16 while every id fits (Megatron's threshold, 65500), else int32: halves the .bin for most vocabularies."""
    return np.uint16 if vocab_size < 65500 else np.int32


def idx_path(prefix: str) -> str:
    return prefix + ".idx"


def bin_path(prefix: str) -> str:
    return prefix + ".bin"


def ids_path(prefix: str) -> str:
    return prefix + ".ids.json"


def write_index(path: str, dtype, sequence_lengths: np.ndarray, document_indices: np.ndarray) -> None:
    """Write a ``.idx`` file (no sequence modes, as Megatron does for text)."""
    dtype = np.dtype(dtype)
    lengths = np.asarray(sequence_lengths, dtype=np.int32)
    pointers = np.zeros(len(lengths), dtype=np.int64)
    np.cumsum(lengths[:-1], dtype=np.int64, out=pointers[1:])
    pointers *= dtype.itemsize
    docs = np.asarray(document_indices, dtype=np.int64)
    with open(path, "wb") as f:
        f.write(HEADER)
        f.write(struct.pack("<Q", VERSION))
        f.write(struct.pack("<B", _CODE_OF[dtype]))
        f.write(struct.pack("<Q", len(lengths)))
        f.write(struct.pack("<Q", len(docs)))
        f.write(lengths.tobytes(order="C"))
        f.write(pointers.tobytes(order="C"))
        f.write(docs.tobytes(order="C"))


class IndexedDatasetWriter:
    """Appends documents to ``prefix.bin``/``.idx`` under temporary names; ``finalize`` publishes them.

    Use as a context manager: leaving the block normally finalizes, leaving it by an exception
    (including Ctrl-C) deletes the temporary files and leaves any earlier pair untouched.
    """

    def __init__(self, prefix: str, dtype, tokenizer: Optional[dict] = None):
        """``tokenizer``: the flags that name the tokenizer (``P.ids.json`` records them with the largest id)."""
        self.prefix, self.dtype, self.tokenizer = prefix, np.dtype(dtype), tokenizer
        self.max_token_id = -1
        if self.dtype not in _CODE_OF:
            raise ValueError(f"dtype {self.dtype} has no Megatron code")
        directory = os.path.dirname(os.path.abspath(prefix))
        os.makedirs(directory, exist_ok=True)
        tag = f".tmp{os.getpid()}"
        self._tmp_bin, self._tmp_idx = bin_path(prefix) + tag, idx_path(prefix) + tag
        self._bin = open(self._tmp_bin, "wb")
        self._lengths: list[np.ndarray] = []
        self.num_tokens = 0

    def add_documents(self, tokens: np.ndarray, lengths: np.ndarray) -> None:
        """Append ``len(lengths)`` documents whose tokens lie back to back in ``tokens``."""
        lengths = np.asarray(lengths, dtype=np.int64)
        if int(lengths.sum()) != len(tokens):
            raise ValueError(f"lengths add up to {int(lengths.sum())} but {len(tokens)} tokens were given")
        if len(tokens) and self.dtype.kind in "ui":
            info = np.iinfo(self.dtype)
            lo, hi = int(tokens.min()), int(tokens.max())
            if lo < info.min or hi > info.max:
                raise ValueError(f"token ids {lo}..{hi} do not fit the dataset dtype {self.dtype}")
            self.max_token_id = max(self.max_token_id, hi)
        self._bin.write(np.ascontiguousarray(tokens, dtype=self.dtype).tobytes())
        self._lengths.append(lengths.astype(np.int32))
        self.num_tokens += len(tokens)

    def add_document(self, tokens) -> None:
        tokens = np.asarray(tokens)
        self.add_documents(tokens, np.array([len(tokens)]))

    @property
    def num_documents(self) -> int:
        return sum(len(x) for x in self._lengths)

    def finalize(self) -> None:
        """Write the index, then rename: old .idx away first, new .bin, new .idx last."""
        self._bin.flush()
        os.fsync(self._bin.fileno())
        self._bin.close()
        lengths = np.concatenate(self._lengths) if self._lengths else np.zeros(0, np.int32)
        write_index(self._tmp_idx, self.dtype, lengths, np.arange(len(lengths) + 1, dtype=np.int64))
        if os.path.exists(idx_path(self.prefix)):
            os.remove(idx_path(self.prefix))  # a crash between the two renames must not pair old .idx with new .bin
        if self.tokenizer is not None:  # before the .idx: a whole pair never sits beside an older pair's record
            record = {"max_token_id": int(self.max_token_id), "sequences": len(lengths), "tokenizer": self.tokenizer}
            with open(ids_path(self.prefix) + ".tmp", "w") as f:
                json.dump(record, f, indent=2)
            os.replace(ids_path(self.prefix) + ".tmp", ids_path(self.prefix))
        os.replace(self._tmp_bin, bin_path(self.prefix))
        os.replace(self._tmp_idx, idx_path(self.prefix))

    def abort(self) -> None:
        self._bin.close()
        for p in (self._tmp_bin, self._tmp_idx):
            if os.path.exists(p):
                os.remove(p)

    def __enter__(self) -> "IndexedDatasetWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.finalize()
        else:
            self.abort()


class IndexedDataset:
    """Read-only view of a ``.bin``/``.idx`` pair; sequences come back as numpy views of the mmap."""

    def __init__(self, prefix: str):
        self.prefix = prefix
        self._open()

    def _open(self) -> None:
        path = idx_path(self.prefix)
        if not os.path.isfile(path) or not os.path.isfile(bin_path(self.prefix)):
            missing = [p for p in (path, bin_path(self.prefix)) if not os.path.isfile(p)]
            raise IndexedDataError(f"{' and '.join(missing)}: no such file (is {self.prefix} the prefix that preprocess_data.py printed?).")
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(_FIXED)
        if head[:len(HEADER)] != HEADER[:len(head)]:
            raise IndexedDataError(f"{path} is not a Megatron indexed-dataset index: it does not start with {HEADER!r}.")
        if len(head) < _FIXED:
            raise IndexedDataError(f"{path} is truncated: {size} bytes, shorter than the {_FIXED}-byte header.")
        version, code, seqs, docs = struct.unpack("<QBQQ", head[len(HEADER):])
        if version != VERSION:
            raise IndexedDataError(f"{path} has index version {version}; only version {VERSION} exists.")
        if code not in DTYPE_CODES:
            raise IndexedDataError(f"{path} has unknown token dtype code {code} (known: {sorted(DTYPE_CODES)}).")
        expected = _FIXED + 12 * seqs + 8 * docs
        if size < expected:
            raise IndexedDataError(f"{path} is truncated: {size} bytes where its header announces {seqs} sequences "
                                   f"and {docs} document entries ({expected} bytes).")
        if size not in (expected, expected + seqs):  # + seqs: Megatron's optional int8 sequence modes
            raise IndexedDataError(f"{path} has {size - expected} bytes more than its header announces; not a Megatron index.")
        self.dtype = np.dtype(DTYPE_CODES[code])
        self._idx = np.memmap(path, dtype=np.uint8, mode="r")
        self.sequence_lengths = self._idx[_FIXED:_FIXED + 4 * seqs].view(np.int32)
        self.sequence_pointers = self._idx[_FIXED + 4 * seqs:_FIXED + 12 * seqs].view(np.int64)
        self.document_indices = self._idx[_FIXED + 12 * seqs:expected].view(np.int64)
        self.sequence_modes = self._idx[expected:].view(np.int8) if size > expected else None
        if docs < 1 or self.document_indices[0] != 0 or self.document_indices[-1] != seqs:
            raise IndexedDataError(f"{path} is corrupt: its document index does not run from 0 to {seqs}.")
        described = int(self.sequence_pointers[-1]) + int(self.sequence_lengths[-1]) * self.dtype.itemsize if seqs else 0
        actual = os.path.getsize(bin_path(self.prefix))
        if actual != described:
            raise IndexedDataError(f"{bin_path(self.prefix)} has {actual} bytes but {path} describes {described}: "
                                   "the two files are not a pair (an interrupted or mixed write?).")
        self._bin = np.memmap(bin_path(self.prefix), dtype=np.uint8, mode="r") if actual else np.zeros(0, np.uint8)

    def __getstate__(self):
        return {"prefix": self.prefix}  # re-mapped in each DataLoader worker rather than pickled

    def __setstate__(self, state):
        self.prefix = state["prefix"]
        self._open()

    def __len__(self) -> int:
        return len(self.sequence_lengths)

    def fingerprint(self) -> dict:
        """What identifies these files in an index cache key (a rewritten file gets new indices)."""
        stat = os.stat(idx_path(self.prefix))
        return {"prefix": os.path.abspath(self.prefix), "idx_bytes": stat.st_size, "idx_mtime_ns": stat.st_mtime_ns}

    @property
    def num_documents(self) -> int:
        return len(self.document_indices) - 1

    @property
    def num_tokens(self) -> int:
        return int(self.sequence_lengths.sum(dtype=np.int64))

    def largest_token_id(self, documents: int = 64, tokens: int = 1 << 20) -> tuple[int, Optional[dict]]:
        """(the largest token id, the tokenizer flags that wrote the data or None), from ``P.ids.json``
        when it describes these files, else from the first and last tokens of about ``documents``
        evenly spaced sequences (at most ``tokens`` in all): a foreign vocabulary shows in nearly every
        document (in its end-of-document id, with --append-eod). -1 for no token."""
        try:
            with open(ids_path(self.prefix)) as f:
                record = json.load(f)
            if record["sequences"] == len(self):
                return int(record["max_token_id"]), record.get("tokenizer")
        except (OSError, ValueError, KeyError, TypeError):
            pass  # no record (Megatron's own preprocessing) or an unreadable one: read a sample
        if len(self) == 0:
            return -1, None
        picks = np.unique(np.linspace(0, len(self) - 1, min(len(self), documents)).astype(np.int64))
        half = max(1, tokens // (2 * len(picks)))
        largest = -1
        for index in picks:
            n = int(self.sequence_lengths[index])
            for part in ((self.get(index),) if n <= 2 * half else (self.get(index, 0, half), self.get(index, n - half, half))):
                if len(part):
                    largest = max(largest, int(part.max()))
        return largest, None

    def get(self, index: int, offset: int = 0, length: Optional[int] = None) -> np.ndarray:
        """Tokens ``[offset, offset+length)`` of sequence ``index`` (to its end when length is None)."""
        full = int(self.sequence_lengths[index])
        if length is None:
            length = full - offset
        if offset < 0 or length < 0 or offset + length > full:
            raise IndexError(f"tokens [{offset}, {offset + length}) of sequence {index} (length {full})")
        start = int(self.sequence_pointers[index]) + offset * self.dtype.itemsize
        return self._bin[start:start + length * self.dtype.itemsize].view(self.dtype)

    def __getitem__(self, index: int) -> np.ndarray:
        return self.get(index)
