"""Records: one JSON line per run, the only place a measured figure lives.

A run is one system (hybridlm or a peer) timing one case once. The runner writes
``records.jsonl`` into its output folder; ``python -m benchmarks render --add FILE`` files a
call's records under ``benchmarks/records/`` (one file per call) and renders RESULTS.md, the
README's headline table and the plot from all of them.

Throughput and MFU are re-derived when rendering wherever the model is known: TFLOP/s =
tokens/s x ``hybridlm.training.metrics.flops_per_token`` of the record's model flags (the
function the trainer logs with, never a copy), MFU = that / the record's peak. So every row
counts FLOPs by one rule, the current one; a record measured under another rule says so
(``rule``). Records of runs before the suite (converted from the old RESULTS.md rows) keep
their published figures where the model cannot be rebuilt from flags.
"""
from __future__ import annotations

import datetime
import glob
import json
import os
import shlex
from dataclasses import dataclass
from typing import Iterable, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
RECORDS_DIR = os.path.join(HERE, "records")

# The throughput figures a training run's record holds (the runner's and scripts/benchmark.py's).
THROUGHPUT = ("tokens_per_sec_per_gpu", "tflops_per_gpu", "mfu", "peak_memory_gib")


def read(path: str) -> list[dict]:
    """The records of one JSONL file, in file order."""
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def append(path: str, record: dict) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


def command_line(program: str, argv: list[str]) -> str:
    """``program`` and its arguments as typed, without ``--record-file PATH`` (plumbing)."""
    shown = [a for i, a in enumerate(argv) if a != "--record-file" and (i == 0 or argv[i - 1] != "--record-file")]
    return " ".join([program] + [shlex.quote(a) for a in shown])


def script_record(program: str, argv: list[str], label: str, figures: dict, *, system: str = "hybridlm", **extra) -> dict:
    """The record of a helper script's run (kernels.py, attention.py, ...): figures as the tables show them."""
    now = datetime.datetime.now()
    return {"system": system, "label": label, "figures": figures, "command": command_line(program, argv),
            "date": now.date().isoformat(), "time": now.isoformat(timespec="seconds"), **extra}


def load_all(directory: str = RECORDS_DIR) -> list[dict]:
    """Every stored record, files in name order, each record's position kept for stable sorting."""
    records = []
    for path in sorted(glob.glob(os.path.join(directory, "*.jsonl"))):
        records.extend(read(path))
    for index, record in enumerate(records):
        record["_order"] = index
    return records


def store(records: Iterable[dict], directory: str = RECORDS_DIR) -> list[str]:
    """File a call's records as ``<call>.jsonl`` (replacing an earlier copy of the same call)."""
    by_call: dict[str, list[dict]] = {}
    for record in records:
        by_call.setdefault(record["call"], []).append(record)
    paths = []
    for call, group in by_call.items():
        path = os.path.join(directory, f"{call}.jsonl")
        os.makedirs(directory, exist_ok=True)
        with open(path, "w") as f:
            for record in group:
                f.write(json.dumps({k: v for k, v in record.items() if not k.startswith("_")}) + "\n")
        paths.append(path)
    return paths


def model_config(model_args: list[str]):
    """The ModelConfig a record's flags build, vocabulary padded for its TP (as the trainer pads it)."""
    from hybridlm.config import parse_args
    run = parse_args(list(model_args))
    cfg = run.model
    if cfg.vocab_size is None:  # the tokenizer's, as the trainer takes it (the built-in byte tokenizer needs no file)
        from hybridlm.data.tokenizers import build_tokenizer
        d = run.data
        cfg.vocab_size = build_tokenizer(d.tokenizer_type, d.tokenizer_model, d.vocab_file, d.merge_file).vocab_size
    cfg.padded_vocab_size = cfg.pad_vocab(run.parallel.tensor_model_parallel_size)
    return cfg


@dataclass(frozen=True)
class Throughput:
    """A record's throughput figures as rendered, and by which FLOPs rule."""

    tokens_per_sec_per_gpu: Optional[float]
    tflops_per_gpu: Optional[float]
    mfu: Optional[float]
    rule: str  # "current", "re-derived (new rule)" or "old rule"


def throughput(record: dict) -> Throughput:
    """TFLOP/s and MFU by the current rule where the record's model can be rebuilt, else as published."""
    from hybridlm.training.metrics import flops_per_token
    tps = record.get("tokens_per_sec_per_gpu")
    if tps is None or not record.get("model_args"):
        return Throughput(tps, record.get("tflops_per_gpu"), record.get("mfu"), record.get("mfu_rule") or "old rule")
    per_token = flops_per_token(model_config(record["model_args"]))
    tflops = tps * per_token / 1e12
    peak = record.get("peak_tflops")
    measured = record.get("flops_per_token")
    same = measured is not None and abs(measured - per_token) <= 1e-6 * per_token
    return Throughput(tps, tflops, tflops / peak if peak else None, "current" if same else "re-derived (new rule)")


def step_spread(record: dict) -> Optional[tuple[float, float]]:
    """(slowest, fastest) timed step in tokens/s/GPU, where the record has its steps."""
    steps = record.get("step_tokens_per_sec_per_gpu")
    return (min(steps), max(steps)) if steps else None
