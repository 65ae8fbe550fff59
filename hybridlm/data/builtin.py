"""The corpus that ships with the package, and the byte-level tokenizer it is read with.

The corpus is the Python language reference (the ``pydoc`` topics, PSF licence): about
465 kB of English prose and code in 79 documents, enough for a tiny model's loss to fall
visibly within a minute on a laptop CPU. Bytes are tokens (256 ids) plus one end-of-document
id, so the default run needs no tokenizer file and no training step.
"""
from __future__ import annotations

import gzip
import json
from importlib import resources

import numpy as np


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


def builtin_tokens() -> np.ndarray:
    """The whole corpus as one token stream, documents separated by EOD."""
    tokenizer = ByteTokenizer()
    ids: list[int] = []
    for doc in builtin_documents():
        ids += tokenizer.encode(doc) + [tokenizer.eod]
    return np.asarray(ids, dtype=np.int64)
