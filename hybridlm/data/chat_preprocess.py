"""Chat JSONL -> token and loss-mask datasets: what ``scripts/preprocess_chat.py`` runs.

Output for ``--output-prefix P``:

    P.bin / P.idx              token ids, one document per conversation (Megatron's indexed format)
    P_mask.bin / P_mask.idx    uint8, aligned with the tokens: 1 where the token is trained
    P.manifest.json            kind (sft | preference), tokenizer and template hashes, counts

Preference data holds each pair as two adjacent documents, chosen then rejected. The reading,
worker and progress machinery is ``preprocess_data``'s (``hybridlm.data.preprocess``); each line
becomes a conversation (``chat_formats``), is rendered with the chat template and masked from
prefix renderings (``chat_template``). A conversation longer than ``--seq-length`` + 1 tokens (a
row of ``--seq-length`` inputs and as many labels) keeps its start; one with no trained token is
dropped, and its line and the reason reported (an error only if every one is). A bad line (not
JSON, an unknown role, a preference prompt that leaves no room for a reply in the sequence, ...)
stops the run with ``file:line: reason`` unless ``skip_bad_lines``, which skips and reports it.
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Optional, Sequence

import numpy as np

from ..config import ConfigError
from .chat_formats import LineError, Pair, is_preference, read_conversation, read_pair
from .chat_template import ChatTemplate, TemplateError, assistant_spans, encoding_sha256, load_template, token_mask
from .indexed import IndexedDatasetWriter, optimal_dtype
from .preprocess import BadInputError, Chunk, PreprocessStats, Progress, _parse_json, encode_in_order, expand_inputs
from .tokenizers import load_huggingface_tokenizer

MANIFEST_FORMAT = "hybridlm-chat"
MANIFEST_VERSION = 1
TRAIN_ON = ("all", "last")


def mask_prefix(prefix: str) -> str:
    return prefix + "_mask"


def manifest_path(prefix: str) -> str:
    return prefix + ".manifest.json"


@dataclass(frozen=True)
class ChatOptions:
    """What a worker needs to rebuild the tokenizer and template (picklable, hashable)."""
    tokenizer_model: str
    template: ChatTemplate
    seq_length: Optional[int]
    train_on: str
    dtype: str
    skip_bad_lines: bool = False


@dataclass
class ChatChunkResult:
    path: str
    kind: Optional[str]  # "sft" | "preference" | None (no line)
    first_line: int
    tokens: np.ndarray
    mask: np.ndarray
    lengths: np.ndarray
    num_bytes: int
    dropped: list = field(default_factory=list)  # (line, reason): written nothing, no trained token
    skipped: list = field(default_factory=list)  # (line, reason): a bad line, --skip-bad-lines
    truncated: int = 0
    loss_tokens: int = 0
    max_prompt: int = 0


@lru_cache(maxsize=4)
def _rust_tokenizer(path: str):
    return load_huggingface_tokenizer(path).tok


def _encode(tok, template: ChatTemplate, conversation, seq_length: Optional[int]) -> tuple[np.ndarray, np.ndarray, bool]:
    """(ids, mask, truncated) of one conversation."""
    text, spans = assistant_spans(template, conversation.messages, conversation.trained, conversation.tools)
    encoding = tok.encode(text, add_special_tokens=False)
    ids = np.asarray(encoding.ids, dtype=np.int64)
    mask = token_mask(encoding.offsets, spans)
    truncated = seq_length is not None and len(ids) > seq_length + 1
    if truncated:
        ids, mask = ids[: seq_length + 1], mask[: seq_length + 1]
    mask[0] = 0  # the first token is never a label
    return ids, mask, truncated


def _untrained(conversation, truncated: bool, seq_length: Optional[int]) -> str:
    """Why a conversation holds no trained token (it is dropped, and this said with its line)."""
    if not any(m["role"] == "assistant" for m in conversation.messages):
        return "no assistant turn, so nothing to train"
    if not conversation.trained:
        return "no assistant turn in the loss (\"loss\": false, or --train-on last and the last one is)"
    if truncated:
        return f"--seq-length {seq_length} cuts it before its first trained reply"
    return "its trained replies render to no token"


def _read_line(raw: bytes, options: ChatOptions, tok, result: ChatChunkResult):
    """(kind, sides, encoded sides) of one line; LineError, TemplateError or BadInputError for a bad one."""
    obj, reason = _parse_json(raw)
    if reason is not None:
        raise LineError(reason)
    kind = "preference" if is_preference(obj) else "sft"
    if result.kind is not None and kind != result.kind:
        raise BadInputError(f"a {kind} example among {result.kind} examples; keep supervised and preference data in separate files.")
    record = read_pair(obj) if kind == "preference" else read_conversation(obj, options.train_on)
    sides = [record.chosen, record.rejected] if isinstance(record, Pair) else [record]
    encoded = [_encode(tok, options.template, c, options.seq_length) for c in sides]
    if kind == "preference":
        for (ids, mask, _), side in zip(encoded, ("chosen", "rejected")):
            prompt = int(np.argmax(mask)) if mask.any() else len(ids)
            if options.seq_length is not None and prompt > options.seq_length:
                raise LineError(f"the {side} prompt is {prompt} tokens, longer than --seq-length {options.seq_length} leaves "
                                "room for (a reply needs at least one position); raise --seq-length or shorten the prompt")
    return kind, sides, encoded


def encode_chat_chunk(chunk: Chunk, options: ChatOptions, shared=None) -> ChatChunkResult:
    """Parse, render, tokenize and mask one chunk's lines. Raises BadInputError at the first bad line
    (unless ``options.skip_bad_lines``); a line that trains nothing is dropped with its reason."""
    tok = shared if shared is not None else _rust_tokenizer(options.tokenizer_model)
    ids_out, mask_out, lengths = [], [], []
    result = ChatChunkResult(chunk.path, None, chunk.first_line, None, None, None, len(chunk.data))
    for offset, raw in enumerate(chunk.data.split(b"\n")):
        if not raw.strip():
            continue
        line = chunk.first_line + offset
        try:
            kind, sides, encoded = _read_line(raw, options, tok, result)
        except (LineError, TemplateError) as e:
            reason = str(e).rstrip(".")
            if not options.skip_bad_lines:
                raise BadInputError(f"{chunk.path}:{line}: {reason}.") from None
            result.skipped.append((line, reason))
            continue
        except BadInputError as e:
            raise BadInputError(f"{chunk.path}:{line}: {e}") from None
        result.kind = kind
        if kind == "preference":
            result.max_prompt = max([result.max_prompt] + [int(np.argmax(mask)) if mask.any() else len(ids)
                                                           for ids, mask, _ in encoded])
        untrained = [(side, truncated) for side, (_, mask, truncated) in zip(sides, encoded) if not mask.any()]
        if untrained:
            side, truncated = untrained[0]
            which = "" if kind == "sft" else f"the {'chosen' if side is sides[0] else 'rejected'} reply: "
            result.dropped.append((line, which + _untrained(side, truncated, options.seq_length)))
            continue
        for ids, mask, truncated in encoded:
            ids_out.append(ids)
            mask_out.append(mask)
            lengths.append(len(ids))
            result.truncated += truncated
            result.loss_tokens += int(mask.sum())
    dtype = np.dtype(options.dtype)
    result.tokens = np.concatenate(ids_out).astype(dtype) if ids_out else np.zeros(0, dtype)
    result.mask = np.concatenate(mask_out) if mask_out else np.zeros(0, np.uint8)
    result.lengths = np.asarray(lengths, dtype=np.int32)
    return result


@dataclass
class ChatStats(PreprocessStats):
    kind: Optional[str] = None
    samples: int = 0  # conversations (sft) or pairs (preference) written
    dropped: int = 0
    dropped_examples: list = field(default_factory=list)  # "file:line: reason", the first few
    truncated: int = 0
    loss_tokens: int = 0
    max_tokens: int = 0
    max_prompt: int = 0
    manifest: dict = field(default_factory=dict)

    def summary(self) -> str:
        s = max(self.seconds, 1e-9)
        what = "pairs" if self.kind == "preference" else "conversations"
        text = (f"{self.files} file(s), {self.samples:,} {what} ({self.documents:,} documents), {self.tokens:,} tokens of which "
                f"{self.loss_tokens:,} trained, {self.dropped:,} dropped (no trained token), {self.truncated:,} truncated, "
                f"{self.bad_lines:,} bad line(s) skipped, "
                f"{self.bytes_in / 1e6:,.1f} MB in {self.seconds:.1f} s ({self.documents / s:,.0f} docs/s)")
        for prefix in self.outputs.values():
            text += f"\n  -> {prefix}.bin/.idx, {mask_prefix(prefix)}.bin/.idx, {manifest_path(prefix)}   (train with --data-path {prefix})"
        return text


def preprocess_chat(inputs: Sequence[str], output_prefix: str, tokenizer_model: str, *, chat_template: Optional[str] = None,
                    seq_length: Optional[int] = None, train_on: str = "all", workers: int = 1, chunk_bytes: int = 1 << 21,
                    progress: bool = True, skip_bad_lines: bool = False) -> ChatStats:
    """Write the token, mask and manifest files for ``inputs``; returns the counts. Bad input raises
    ``ConfigError`` with ``file:line: reason`` (a bad line is skipped and counted with ``skip_bad_lines``);
    nothing is published unless everything succeeded."""
    if workers < 1:
        raise ConfigError(f"--workers must be at least 1, got {workers}.")
    if train_on not in TRAIN_ON:
        raise ConfigError(f"--train-on {train_on}: choose all or last.")
    if seq_length is not None and seq_length < 1:
        raise ConfigError(f"--seq-length must be positive, got {seq_length}.")
    tokenizer = load_huggingface_tokenizer(tokenizer_model)
    template = load_template(tokenizer_model if os.path.isdir(tokenizer_model) else os.path.dirname(tokenizer_model), chat_template)
    paths = expand_inputs(inputs)
    options = ChatOptions(tokenizer_model, template, seq_length, train_on, np.dtype(optimal_dtype(tokenizer.vocab_size)).name,
                          skip_bad_lines)
    stats = ChatStats(files=len(paths))
    bar = Progress(stats, sum(os.path.getsize(p) for p in paths), enabled=progress)
    start = time.perf_counter()
    tokens_out = IndexedDatasetWriter(output_prefix, options.dtype)
    mask_out = IndexedDatasetWriter(mask_prefix(output_prefix), np.uint8)

    def consume(result: ChatChunkResult) -> None:
        if result.kind is not None:
            if stats.kind is None:
                stats.kind = result.kind
            elif result.kind != stats.kind:
                raise BadInputError(f"{result.path}:{result.first_line}: {result.kind} examples after {stats.kind} examples; "
                                    "keep supervised and preference data in separate runs.")
        tokens_out.add_documents(result.tokens, result.lengths)
        mask_out.add_documents(result.mask, result.lengths)
        stats.documents += len(result.lengths)
        stats.samples += len(result.lengths) // (2 if result.kind == "preference" else 1)
        stats.tokens += len(result.tokens)
        stats.bytes_in += result.num_bytes
        stats.dropped += len(result.dropped)
        stats.bad_lines += len(result.skipped)
        for line, reason in result.dropped[:max(0, 20 - len(stats.dropped_examples))]:
            stats.dropped_examples.append(f"{result.path}:{line}: {reason}")
        for line, reason in result.skipped[:max(0, 20 - len(stats.bad_examples))]:
            stats.bad_examples.append(f"{result.path}:{line}: {reason}")
        stats.truncated += result.truncated
        stats.loss_tokens += result.loss_tokens
        stats.max_tokens = max(stats.max_tokens, int(result.lengths.max(initial=0)))
        stats.max_prompt = max(stats.max_prompt, result.max_prompt)

    def empty_file(path: str) -> None:
        raise BadInputError(f"{path}:1: the file is empty.")

    try:
        encode_in_order(paths, encode_chat_chunk, options, tokenizer.tok if workers == 1 else None, workers=workers,
                        chunk_bytes=chunk_bytes, bar=bar, consume=consume, empty_file=empty_file)
        if stats.samples == 0:
            first = f", the first {stats.dropped_examples[0]}" if stats.dropped_examples else ""
            raise BadInputError(f"no example with a trained token in {', '.join(paths)} ({stats.dropped} dropped{first}; "
                                f"{stats.bad_lines} bad line(s) skipped); nothing to write.")
    except BaseException:
        tokens_out.abort()
        mask_out.abort()
        raise
    stats.seconds = time.perf_counter() - start
    stats.manifest = {
        "format": MANIFEST_FORMAT, "version": MANIFEST_VERSION, "kind": stats.kind,
        "tokenizer": {"path": os.path.abspath(tokenizer_model), "sha256": encoding_sha256(tokenizer_model)},
        "template": {"source": template.source, "sha256": template.sha256, "text": template.text},
        "seq_length": seq_length, "train_on": train_on, "inputs": [os.path.abspath(p) for p in paths],
        "samples": stats.samples, "documents": stats.documents, "tokens": stats.tokens, "loss_tokens": stats.loss_tokens,
        "dropped_no_loss_tokens": stats.dropped, "truncated": stats.truncated,
        "max_tokens": stats.max_tokens, "max_prompt_tokens": stats.max_prompt if stats.kind == "preference" else None,
    }
    tmp = f"{manifest_path(output_prefix)}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(stats.manifest, f, indent=2)
        f.write("\n")
    # the manifest goes last: its presence says the pair of datasets beside it is whole
    if os.path.exists(manifest_path(output_prefix)):
        os.remove(manifest_path(output_prefix))
    tokens_out.finalize()
    mask_out.finalize()
    os.replace(tmp, manifest_path(output_prefix))
    bar.close()
    stats.outputs = {"chat": output_prefix}
    return stats
