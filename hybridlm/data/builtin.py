"""The corpus that ships with the package, and the byte-level tokenizer it is read with.

The corpus is the Python language reference (the ``pydoc`` topics, PSF licence): about
465 kB of English prose and code in 79 documents, enough for a tiny model's loss to fall
visibly within a minute on a laptop CPU. Bytes are tokens (256 ids) plus one end-of-document
id, so the default run needs no tokenizer file and no training step.
"""
from __future__ import annotations

import fcntl
import gzip
import json
import os
from importlib import resources

import numpy as np

from .indexed import IndexedDatasetWriter, idx_path


class ByteTokenizer:
    """UTF-8 bytes as token ids 0..255; id 256 ends a document."""
    vocab_size = 257
    eod = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


def builtin_documents() -> list[str]:
    with resources.files(__package__).joinpath("builtin/corpus.jsonl.gz").open("rb") as raw:
        with gzip.open(raw, "rt", encoding="utf-8") as lines:
            return [json.loads(line)["text"] for line in lines]


def builtin_prefix(cache_dir: str | None = None) -> str:
    """The built-in corpus as a Megatron-format dataset (byte tokens), written once into a cache
    folder, so the default run goes through the same dataset code as ``--data-path``.
    Ranks that start together take a file lock: one writes, the others find it written."""
    cache_dir = cache_dir or os.environ.get("HYBRIDLM_CACHE", os.path.expanduser("~/.cache/hybridlm"))
    prefix = os.path.join(cache_dir, "builtin", "python_reference_bytes")
    os.makedirs(os.path.dirname(prefix), exist_ok=True)
    with open(prefix + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not os.path.exists(idx_path(prefix)):
            tokenizer = ByteTokenizer()
            with IndexedDatasetWriter(prefix, np.uint16) as writer:
                for doc in builtin_documents():
                    writer.add_document(tokenizer.encode(doc) + [tokenizer.eod])
    return prefix
