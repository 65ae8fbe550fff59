"""What a user types: the `deepspeed` launcher running scripts/pretrain.py on CPU."""
from __future__ import annotations

import json
import time

import pytest

from harness import launch_deepspeed as _launch
from oracle import TINY

pytestmark = pytest.mark.slow


def _losses(path) -> list[float]:
    with open(path) as f:
        return [json.loads(line)["loss"] for line in f]


def test_deepspeed_launcher_tp2_pp2_gives_the_single_process_losses(tmp_path):
    common = ["scripts/pretrain.py", "--deepspeed_config", "ds_configs/zero1.json", *TINY, "--train-iters", "3",
              "--log-interval", "1"]
    single = _launch(["--num_gpus", "1", *common, "--metrics-file", str(tmp_path / "one.jsonl")])
    assert single.returncode == 0, single.stderr[-3000:]
    split = _launch(["--num_gpus", "4", *common, "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
                     "--metrics-file", str(tmp_path / "four.jsonl")])
    assert split.returncode == 0, split.stderr[-3000:]
    want, got = _losses(tmp_path / "one.jsonl"), _losses(tmp_path / "four.jsonl")
    assert len(want) == len(got) == 3
    for step, (a, b) in enumerate(zip(want, got), start=1):
        assert abs(a - b) <= 1e-5 * abs(a), f"step {step}: TP2xPP2 loss {b} != single-process {a}"
    record = json.loads(open(tmp_path / "four.jsonl").readline())
    assert {"iteration", "loss", "lr", "grad_norm", "tokens_per_sec", "tflops_per_gpu", "mfu"} <= set(record)


def test_deepspeed_launcher_bad_layout_exits_fast_with_one_sentence_per_rank():
    started = time.monotonic()
    result = _launch(["--num_gpus", "2", "scripts/pretrain.py", "--deepspeed_config", "ds_configs/zero2.json",
                      "--pipeline-model-parallel-size", "2"], timeout=120)
    assert result.returncode != 0
    sentence = "cannot be combined with --pipeline-model-parallel-size 2"
    assert result.stderr.count(sentence) == 2, result.stderr[-2000:]  # one per rank
    assert "Traceback" not in result.stderr
    assert time.monotonic() - started < 60


def test_default_run_trains_the_builtin_model_and_loss_falls(tmp_path):
    # Exactly the README's command (plus a metrics file to read the losses back).
    result = _launch(["scripts/pretrain.py", "--deepspeed_config", "ds_configs/zero1.json",
                      "--metrics-file", str(tmp_path / "m.jsonl")], timeout=420)
    assert result.returncode == 0, result.stderr[-3000:]
    losses = _losses(tmp_path / "m.jsonl")
    assert len(losses) == 30
    assert losses[-1] < 0.6 * losses[0], f"loss did not fall enough: {losses[0]:.3f} -> {losses[-1]:.3f}"
