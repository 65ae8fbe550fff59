"""The stage protocol of the benchmark scripts that time hybridlm beside another framework on one GPU
(sft_throughput.py, grpo_throughput.py, qlora_throughput.py).

Each stage (hybridlm's run, the peer's, ...) runs in a process of its own, the script calling itself with
``--stage NAME``: fresh GPU memory and its own peak, and no state shared between frameworks. A stage
prints its figures as one last line ``RESULT {json}``; the parent reads that line, or a failed stage's
last lines, and at the end writes every stage's result, the table and the records.
"""
from __future__ import annotations

import json
import os
import subprocess
import time
import sys
from typing import Callable, Iterable

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PREFIX = "RESULT "
# the --tiny smoke runs' Qwen2-style shape (CPU, fp32), shared by the SFT and GRPO throughput scripts
TINY_QWEN2 = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  vocab_size=512, max_position_embeddings=1024, tie_word_embeddings=True)


def report(result: dict) -> None:
    """What a stage prints last: its figures, for ``run_stage`` to read."""
    print(PREFIX + json.dumps(result), flush=True)


def run_stage(script: str, stage: str, options: list[str], log: str) -> dict:
    """``python script --stage stage options...`` in its own process, its output in ``log``; the stage's
    result, or {} (after printing the end of its log) when it failed."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    with open(log, "w") as f:
        code = subprocess.call([sys.executable, os.path.abspath(script), "--stage", stage] + options,
                               stdout=f, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    lines = [line for line in open(log) if line.startswith(PREFIX)]
    if code != 0 or not lines:
        tail = open(log).read().splitlines()[-8:]
        print(f"[{stage}] failed (exit {code}); end of {log}:\n  " + "\n  ".join(tail), flush=True)
        return {}
    return json.loads(lines[-1][len(PREFIX):])


def finish(results: dict, results_file: str, table: str, records: Callable[[], Iterable[dict]], record_file: str | None) -> None:
    """Keep every stage's result, print the table, and append the records when a record file is asked for."""
    with open(results_file, "w") as f:
        json.dump(results, f, indent=2)
    print(table, flush=True)
    if record_file:
        from .records import append
        for record in records():
            append(record_file, record)


def synchronized_now() -> float:
    """The host clock once the GPU (if any) has finished what was queued: a step's end as the device sees it."""
    import torch
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter()


def step_clock():
    """(callback, ends) for a transformers Trainer: ``ends`` gets the time the first step began and then each
    optimizer step's end, so a step's time runs from the previous end and includes fetching and collating its
    micro-batches (and, under TRL's GRPO, its generation), as hybridlm's iteration time does."""
    import transformers
    ends: list[float] = []

    class StepClock(transformers.TrainerCallback):
        def on_step_begin(self, *unused, **kwargs):
            if not ends:
                ends.append(synchronized_now())

        def on_step_end(self, *unused, **kwargs):
            ends.append(synchronized_now())

    return StepClock(), ends
