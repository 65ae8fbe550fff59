"""JSONL (plain, .gz or .zst) -> Megatron ``.bin``/``.idx``, streamed in chunks and encoded in parallel.

The pipeline, and why each piece:

* The main process reads each input in chunks of whole lines (``chunk_bytes``), so memory
  stays flat on files larger than RAM: at most a few chunks are in flight at once.
* A chunk is parsed and encoded by ``encode_chunk``: JSON per line, then one
  ``encode_batch`` call for the whole chunk, which the Rust tokenizer spreads over its own
  thread pool with the GIL released. With ``workers=1`` two threads of this process take
  turns, so one chunk's Python work (JSON, ids -> numpy) overlaps the next chunk's encoding;
  with ``workers=N>1`` there are N processes, each with cores/N tokenizer threads.
* Results are written in input order (so the output is identical for any worker count)
  to temporary files that are renamed into place only when everything succeeded.

A bad line (malformed JSON, missing key, non-string value, invalid UTF-8, empty document)
stops the run with ``file:line: reason`` unless ``skip_bad_lines``, which skips and counts it.
"""
from __future__ import annotations

import collections
import concurrent.futures as cf
import glob
import gzip
import io
import json
import multiprocessing
import os
import sys
import time
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Iterator, Optional, Sequence

import numpy as np

from ..config import ConfigError
from .indexed import IndexedDatasetWriter, optimal_dtype
from .tokenizers import TokenizerSpec


class BadInputError(ConfigError):
    """An input file or line that cannot be turned into a document."""


@dataclass
class Chunk:
    """Whole lines of one file, and the 1-based number of the first."""
    path: str
    first_line: int
    data: bytes


@dataclass
class ChunkResult:
    path: str
    tokens: dict  # key -> flat token array (dataset dtype)
    lengths: dict  # key -> int32 document lengths
    bad: list  # (line number, reason)
    num_bytes: int


# ---------------------------------------------------------------- reading

def expand_inputs(patterns: Sequence[str]) -> list[str]:
    """Paths and globs -> sorted existing files; a name that matches nothing is an error, not a no-op."""
    paths = []
    for pattern in patterns:
        if glob.has_magic(pattern):
            matches = sorted(p for p in glob.glob(pattern) if os.path.isfile(p))
            if not matches:
                raise BadInputError(f"--input {pattern}: the pattern matches no file.")
            paths += matches
        elif os.path.isdir(pattern):
            raise BadInputError(f"--input {pattern}: is a directory; give files or a glob such as {pattern}/*.jsonl.")
        elif not os.path.isfile(pattern):
            raise BadInputError(f"--input {pattern}: no such file.")
        else:
            paths.append(pattern)
    return paths


def _open_binary(path: str, raw) -> io.RawIOBase:
    if path.endswith(".gz"):
        return gzip.GzipFile(fileobj=raw, mode="rb")
    if path.endswith(".zst") or path.endswith(".zstd"):
        try:
            import zstandard
        except ImportError:
            raise BadInputError(f"{path}: reading .zst needs the zstandard package (pip install zstandard).") from None
        return io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(raw, read_across_frames=True), 1 << 20)
    return raw


def read_chunks(path: str, chunk_bytes: int = 1 << 21, progress=None) -> Iterator[Chunk]:
    """Whole-line chunks of about ``chunk_bytes`` decompressed bytes; the last line may lack its newline."""
    with open(path, "rb") as raw:
        stream = _open_binary(path, raw)
        line, partial = 1, []  # partial: pieces of a line not yet ended by a newline
        while True:
            try:
                block = stream.read(chunk_bytes)
            except (OSError, EOFError, ValueError) as e:  # truncated gzip, corrupt zstd frame
                raise BadInputError(f"{path}:{line}: the compressed stream is corrupt or truncated ({e}).") from None
            if progress is not None:
                progress.disk_position(raw.tell())
            if not block:
                if partial:
                    yield Chunk(path, line, b"".join(partial))
                return
            cut = block.rfind(b"\n") + 1
            if cut == 0:  # a line longer than a chunk: keep collecting it
                partial.append(block)
                continue
            data = b"".join(partial + [block[:cut]])
            partial = [block[cut:]] if cut < len(block) else []
            yield Chunk(path, line, data)
            line += data.count(b"\n")


# ---------------------------------------------------------------- encoding (runs in workers)

@dataclass(frozen=True)
class EncodeOptions:
    spec: TokenizerSpec
    json_keys: tuple = ("text",)
    append_eod: bool = False
    skip_bad_lines: bool = False
    dtype: str = "uint16"


@lru_cache(maxsize=4)
def _tokenizer(spec: TokenizerSpec):
    """One tokenizer per process and spec, built on first use (workers get the spec, not the object)."""
    return spec.build()


def _worker_init(threads: int) -> None:
    # Read by the tokenizer's Rust thread pool when it starts, i.e. at the first encode in this
    # process; a value the user exported wins.
    os.environ.setdefault("RAYON_NUM_THREADS", str(threads))


def _parse_json(raw: bytes):
    """(object, None) or (None, reason) for one line that must hold a JSON object."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        return None, f"invalid UTF-8 (byte 0x{raw[e.start]:02x} at column {e.start + 1})"
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        return None, f"malformed JSON ({e.msg} at column {e.colno})"
    if not isinstance(obj, dict):
        return None, f"a JSON {type(obj).__name__}, not an object"
    return obj, None


def _parse_line(raw: bytes, keys: Sequence[str]):
    """(texts, None) or (None, reason)."""
    obj, reason = _parse_json(raw)
    if reason is not None:
        return None, reason
    texts = []
    for key in keys:
        if key not in obj:
            return None, f"no key '{key}'"
        value = obj[key]
        if not isinstance(value, str):
            return None, f"'{key}' is a JSON {'null' if value is None else type(value).__name__}, not a string"
        if not value:
            return None, f"empty document in '{key}'"
        texts.append(value)
    return texts, None


def _encode_texts(tokenizer, texts: list[str], lines: list[int], bad: list) -> tuple[list, list[int]]:
    """encode_batch over all texts; a text the tokenizer refuses (lone surrogates) is found and reported alone."""
    try:
        return tokenizer.encode_batch(texts), lines
    except Exception:
        keep_ids, keep_lines = [], []
        for text, line in zip(texts, lines):
            try:
                keep_ids.append(tokenizer.encode(text))
                keep_lines.append(line)
            except Exception as e:
                bad.append((line, f"the tokenizer refused the text ({type(e).__name__}: {str(e)[:80]})"))
        return keep_ids, keep_lines


def encode_chunk(chunk: Chunk, options: EncodeOptions, tokenizer=None) -> ChunkResult:
    """Parse and tokenize one chunk. Raises BadInputError at the first bad line unless skipping.
    Worker processes pass no tokenizer and build (once) the one ``options.spec`` names."""
    tokenizer = tokenizer if tokenizer is not None else _tokenizer(options.spec)
    keys, dtype = options.json_keys, np.dtype(options.dtype)
    bad: list = []
    texts: list[list[str]] = [[] for _ in keys]
    lines: list[int] = []
    for offset, raw in enumerate(chunk.data.split(b"\n")):
        if not raw.strip():
            continue  # blank lines (and the empty tail after the last newline) carry no document
        values, reason = _parse_line(raw, keys)
        if reason is None:
            for column, value in zip(texts, values):
                column.append(value)
            lines.append(chunk.first_line + offset)
        elif options.skip_bad_lines:
            bad.append((chunk.first_line + offset, reason))
        else:
            raise BadInputError(f"{chunk.path}:{chunk.first_line + offset}: {reason}.")
    encoded = []  # per key: {line: ids}
    for column in texts:
        ids, ok_lines = _encode_texts(tokenizer, column, lines, bad)
        encoded.append(dict(zip(ok_lines, ids)))
    if not options.append_eod:  # with an EOD appended no document is empty
        for key, docs in zip(keys, encoded):
            for line, ids in docs.items():
                if not ids:
                    bad.append((line, f"the document in '{key}' encodes to no token"))
    if bad and not options.skip_bad_lines:
        line, reason = min(bad)
        raise BadInputError(f"{chunk.path}:{line}: {reason}.")
    # A line bad for one key is dropped for every key, so the outputs stay document-aligned.
    dropped = {line for line, _ in bad}
    keep = [line for line in lines if line not in dropped]
    eod = [tokenizer.eod] if options.append_eod else []
    tokens, lengths = {}, {}
    for key, docs in zip(keys, encoded):
        parts = [np.array(docs[line] + eod, dtype=dtype) for line in keep]
        tokens[key] = np.concatenate(parts) if parts else np.zeros(0, dtype)
        lengths[key] = np.fromiter(map(len, parts), dtype=np.int32, count=len(parts))
    return ChunkResult(chunk.path, tokens, lengths, sorted(bad), len(chunk.data))


# ---------------------------------------------------------------- the run

@dataclass
class PreprocessStats:
    outputs: dict = field(default_factory=dict)  # key -> prefix written
    files: int = 0
    documents: int = 0
    tokens: int = 0
    bytes_in: int = 0
    bad_lines: int = 0
    bad_examples: list = field(default_factory=list)  # "file:line: reason", the first few
    empty_files: list = field(default_factory=list)
    seconds: float = 0.0

    def summary(self) -> str:
        s = max(self.seconds, 1e-9)
        text = (f"{self.files} file(s), {self.documents:,} documents, {self.tokens:,} tokens, "
                f"{self.bad_lines:,} bad line(s) skipped, {self.bytes_in / 1e6:,.1f} MB in {self.seconds:.1f} s "
                f"({self.bytes_in / 1e6 / s:.2f} MB/s, {self.documents / s:,.0f} docs/s, {self.tokens / s:,.0f} tokens/s)")
        for key, prefix in self.outputs.items():
            text += f"\n  '{key}' -> {prefix}.bin/.idx   (train with --data-path {prefix})"
        return text


class Progress:
    """One status line on stderr, rewritten at most twice a second (a new line each 30 s when not a terminal)."""

    def __init__(self, stats: PreprocessStats, total_disk_bytes: int, enabled: bool = True, stream=sys.stderr):
        self.stats, self.total, self.enabled, self.stream = stats, max(total_disk_bytes, 1), enabled, stream
        self.tty = enabled and stream.isatty()
        self.start = self.last = time.perf_counter()
        self.disk_done = self.disk_here = 0

    def disk_position(self, position: int) -> None:
        self.disk_here = position

    def next_file(self, size: int) -> None:
        self.disk_done += size
        self.disk_here = 0

    def update(self, force: bool = False) -> None:
        now = time.perf_counter()
        if not self.enabled or (not force and now - self.last < (0.5 if self.tty else 30.0)):
            return
        self.last, s, elapsed = now, self.stats, max(now - self.start, 1e-9)
        percent = 100.0 * min(1.0, (self.disk_done + self.disk_here) / self.total)
        line = (f"{percent:5.1f}%  {s.documents:,} docs  {s.tokens:,} tokens  {s.bytes_in / 1e6:,.0f} MB  "
                f"{s.documents / elapsed:,.0f} docs/s  {s.bytes_in / 1e6 / elapsed:.2f} MB/s  {s.bad_lines} bad")
        self.stream.write(("\r" + line + "\x1b[K") if self.tty else line + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.enabled:
            self.update(force=True)
            if self.tty:
                self.stream.write("\n")


def _executor(workers: int):
    if workers == 1:
        # Two threads: while one is inside encode_batch (GIL released, Rust threads on every core)
        # the other parses JSON or converts ids; the tokenizer is shared (it is thread-safe).
        return cf.ThreadPoolExecutor(2), 2
    threads = max(1, (os.cpu_count() or 1) // workers)
    ctx = multiprocessing.get_context("spawn")  # no inherited thread pools or locks
    return cf.ProcessPoolExecutor(workers, mp_context=ctx, initializer=_worker_init, initargs=(threads,)), workers


def encode_in_order(paths: Sequence[str], encode, options, shared, *, workers: int, chunk_bytes: int, bar: "Progress",
                    consume, empty_file) -> None:
    """``encode(chunk, options, shared)`` over every chunk of ``paths`` in ``workers`` threads or
    processes, a few chunks in flight; ``consume(result)`` sees the results in input order (so the
    output does not depend on the worker count) and ``empty_file(path)`` each file with no line."""
    executor, parallel = _executor(workers)
    pending: collections.deque = collections.deque()

    def drain(limit: int) -> None:
        while len(pending) > limit:
            consume(pending.popleft().result())
            bar.update()

    try:
        for path in paths:
            chunks_here = 0
            for chunk in read_chunks(path, chunk_bytes, bar):
                chunks_here += 1
                pending.append(executor.submit(encode, chunk, options, shared))
                drain(2 * parallel)
            bar.next_file(os.path.getsize(path))
            if chunks_here == 0:
                empty_file(path)
        drain(0)
    except BaseException:
        executor.shutdown(wait=False, cancel_futures=True)
        raise
    executor.shutdown()


def output_prefix_for(output_prefix: str, key: str) -> str:
    """Megatron's naming: ``<prefix>_<key>_document``, what existing recipes pass to --data-path."""
    return f"{output_prefix}_{key}_document"


def preprocess(inputs: Sequence[str], output_prefix: str, spec: TokenizerSpec = TokenizerSpec(), *,
               json_keys: Sequence[str] = ("text",), append_eod: bool = False, workers: int = 1,
               skip_bad_lines: bool = False, chunk_bytes: int = 1 << 21, progress: bool = True) -> PreprocessStats:
    """Tokenize ``inputs`` into one .bin/.idx pair per JSON key; returns the counts. Raises
    ``ConfigError`` (``BadInputError``) with ``file:line: reason`` on bad input."""
    if workers < 1:
        raise ConfigError(f"--workers must be at least 1, got {workers}.")
    if not json_keys:
        raise ConfigError("--json-keys needs at least one key.")
    tokenizer = spec.build()  # fails here, before any file is opened, on a bad tokenizer flag
    paths = expand_inputs(inputs)
    options = EncodeOptions(spec, tuple(json_keys), append_eod, skip_bad_lines, np.dtype(optimal_dtype(tokenizer.vocab_size)).name)
    stats = PreprocessStats(files=len(paths))
    bar = Progress(stats, sum(os.path.getsize(p) for p in paths), enabled=progress)
    start = time.perf_counter()
    writers = {key: IndexedDatasetWriter(output_prefix_for(output_prefix, key), options.dtype, tokenizer=spec.flags())
               for key in json_keys}
    shared_tokenizer = tokenizer if workers == 1 else None  # threads share it; processes build their own

    def consume(result: ChunkResult) -> None:
        for key in json_keys:
            writers[key].add_documents(result.tokens[key], result.lengths[key])
        stats.documents += len(result.lengths[json_keys[0]])
        stats.tokens += sum(len(t) for t in result.tokens.values())
        stats.bytes_in += result.num_bytes
        stats.bad_lines += len(result.bad)
        for line, reason in result.bad[:max(0, 20 - len(stats.bad_examples))]:
            stats.bad_examples.append(f"{result.path}:{line}: {reason}")

    def empty_file(path: str) -> None:
        if not skip_bad_lines:
            raise BadInputError(f"{path}:1: the file is empty.")
        stats.empty_files.append(path)

    try:
        encode_in_order(paths, encode_chunk, options, shared_tokenizer, workers=workers, chunk_bytes=chunk_bytes,
                        bar=bar, consume=consume, empty_file=empty_file)
        if stats.documents == 0:
            raise BadInputError(f"no document was read from {', '.join(paths)}; nothing to write.")
    except BaseException:
        for w in writers.values():
            w.abort()
        raise
    for w in writers.values():
        w.finalize()
    bar.close()
    stats.seconds = time.perf_counter() - start
    stats.outputs = {key: output_prefix_for(output_prefix, key) for key in json_keys}
    return stats


# ---------------------------------------------------------------- tokenizer training

def iter_documents(inputs: Sequence[str], json_key: str = "text", skip_bad_lines: bool = False) -> Iterator[str]:
    """Each document's text, in order, with the same bad-line rules as ``preprocess``."""
    for path in expand_inputs(inputs):
        empty = True
        for chunk in read_chunks(path):
            empty = False
            for offset, raw in enumerate(chunk.data.split(b"\n")):
                if not raw.strip():
                    continue
                values, reason = _parse_line(raw, (json_key,))
                if reason is None:
                    yield values[0]
                elif not skip_bad_lines:
                    raise BadInputError(f"{path}:{chunk.first_line + offset}: {reason}.")
        if empty and not skip_bad_lines:
            raise BadInputError(f"{path}:1: the file is empty.")


def train_tokenizer(inputs: Sequence[str], output: str, *, vocab_size: int = 32000, json_key: str = "text",
                    min_frequency: int = 2, eod_token: str = "<|endoftext|>", max_documents: Optional[int] = None,
                    skip_bad_lines: bool = False) -> tuple[str, int]:
    """Train a byte-level BPE on the inputs and save it; returns (path, vocabulary size)."""
    import itertools
    from .tokenizers import load_huggingface_tokenizer, save_tokenizer, train_byte_level_bpe
    texts = iter_documents(inputs, json_key, skip_bad_lines)
    if max_documents is not None:
        texts = itertools.islice(texts, max_documents)
    tok = train_byte_level_bpe(texts, vocab_size, min_frequency, eod_token)
    path = save_tokenizer(tok, output, eod_token)
    return path, load_huggingface_tokenizer(path, "--output").vocab_size


# ---------------------------------------------------------------- the scripts' shell

def _interrupt(signum, frame):
    raise KeyboardInterrupt  # SIGTERM (scancel, kill) cleans up like Ctrl-C: temporaries removed, nothing renamed


def run_script(work, error_code: int = 2):
    """(exit code, ``work()``'s result or None) for a preprocessing script: bad input is one line on
    stderr, an interrupt (Ctrl-C, SIGTERM) says that nothing was written."""
    import signal
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        return 0, work()
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return error_code, None
    except KeyboardInterrupt:
        print("interrupted: no output was written.", file=sys.stderr)
        return 130, None
