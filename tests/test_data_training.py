"""End to end: train a tokenizer, preprocess JSONL into two datasets, pre-train on their blend."""
from __future__ import annotations

import json
import sys

from harness import run_command, run_ranks
from oracle import ROOT, ds_config
from hybridlm.presets import LLAMA_BLOCK, LLAMA_OPTIMIZER


def _losses(flags):
    from hybridlm.training.trainer import pretrain
    return [r["loss"] for r in pretrain(flags) if "loss" in r]


def _script(name: str, *args: str) -> str:
    result = run_command([sys.executable, f"scripts/{name}.py", *args], cwd=ROOT, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout + result.stderr


def test_pretrain_on_preprocessed_blended_data(tmp_path):
    from hybridlm.data.builtin import builtin_documents
    docs = builtin_documents()
    for name, part in (("a", docs[::2]), ("b", docs[1::2])):
        with open(tmp_path / f"{name}.jsonl", "w") as f:
            for text in part:
                f.write(json.dumps({"text": text}) + "\n")
    _script("train_tokenizer", "--input", str(tmp_path / "a.jsonl"), str(tmp_path / "b.jsonl"), "--vocab-size", "512",
            "--output", str(tmp_path / "tok"))
    for name in ("a", "b"):
        _script("preprocess_data", "--input", str(tmp_path / f"{name}.jsonl"), "--output-prefix", str(tmp_path / name),
                "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", str(tmp_path / "tok"), "--append-eod",
                "--workers", "1", "--no-progress")
    flags = ["--data-path", "0.3", str(tmp_path / "a_text_document"), "0.7", str(tmp_path / "b_text_document"),
             "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", str(tmp_path / "tok"),
             "--split", "90,10,0", "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
             *LLAMA_BLOCK, *LLAMA_OPTIMIZER, "--lr-warmup-iters", "20", "--min-lr", "3e-4",
             "--seq-length", "64", "--micro-batch-size", "4", "--global-batch-size", "8", "--train-iters", "30",
             "--log-interval", "5", "--eval-interval", "30", "--eval-iters", "1", "--lr", "3e-3",
             "--tensor-model-parallel-size", "2"] + ds_config("zero1")
    losses = run_ranks(2, _losses, flags, timeout=300)[0]
    assert losses[-1] < losses[0] - 0.5, f"loss did not fall on the preprocessed data: {losses}"
