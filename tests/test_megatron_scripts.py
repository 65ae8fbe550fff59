"""Megatron-LM's example launch scripts, scaled down, run under torchrun as a Megatron user runs
them: train, save, run again to resume (tests/megatron_scripts/ holds the copies: every flag kept,
the sizes shrunk through environment variables that default to Megatron's values). The data comes
from scripts/preprocess_data.py run with the guides' own commands, or is Megatron's mock data."""
from __future__ import annotations

import importlib.util
import os
import re
import sys

import pytest
import torch
import yaml

from harness import free_port, retry_on_port_clash, run_command
from megatron_files import corpus_jsonl, gpt2_vocab_and_merges, sentencepiece_model
from oracle import ROOT

pytestmark = pytest.mark.slow
SCRIPTS = os.path.join(ROOT, "tests", "megatron_scripts")


def _run(command: list[str], cwd, env: dict, timeout: float = 300, on_gpu: bool = False) -> str:
    bin_dir = os.path.dirname(sys.executable)
    device = {} if on_gpu else {"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    base = {**os.environ, "PATH": bin_dir + os.pathsep + os.environ.get("PATH", ""), **device, "PYTHONUNBUFFERED": "1", **env}
    # the scripts pass --master_port $MASTER_PORT to torchrun as Megatron's do: a port seen free, retried if taken
    result = retry_on_port_clash(lambda: run_command(command, cwd=cwd, env={**base, "MASTER_PORT": str(free_port())},
                                                        capture_output=True, text=True, timeout=timeout))
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    return result.stdout + result.stderr


def _launch(script: str, args: list[str], cwd, env: dict, on_gpu: bool = False) -> str:
    return _run(["bash", os.path.join(SCRIPTS, script), *args], cwd, env, timeout=600 if on_gpu else 300, on_gpu=on_gpu)


def _preprocess(cwd, *flags: str) -> None:
    _run([sys.executable, os.path.join(ROOT, "scripts", "preprocess_data.py"), *flags, "--no-progress"], cwd, {})


def _iterations(log: str) -> list[int]:
    return [int(m) for m in re.findall(r"^iter\s+(\d+)/", log, flags=re.M)]


def _written_config(run_dir) -> dict:
    with open(os.path.join(run_dir, "config.yaml")) as f:
        return yaml.safe_load(f)


def test_mixtral_8x7b_script_trains_pp2_ep2_saves_and_resumes_without_optimizer_and_rng(tmp_path):
    corpus_jsonl(str(tmp_path / "data.jsonl"))
    tokenizer = sentencepiece_model(str(tmp_path))
    # the guide's command (seeds/000), with the script's tokenizer type
    _preprocess(tmp_path, "--input", "data.jsonl", "--output-prefix", "processed_data", "--tokenizer-type", "Llama2Tokenizer",
                "--tokenizer-model", tokenizer, "--workers", "2", "--append-eod")
    shrunk = dict(GPUS_PER_NODE="4", SEQ_LENGTH="64", MAX_POSITION_EMBEDDINGS="256", NUM_LAYERS="4", HIDDEN_SIZE="64",
                  FFN_HIDDEN_SIZE="128", NUM_ATTENTION_HEADS="4", NUM_QUERY_GROUPS="2", NUM_EXPERTS="4",
                  GLOBAL_BATCH_SIZE="8", LR_DECAY_ITERS="8", LR_WARMUP_ITERS="2", PIPELINE_MODEL_PARALLEL_SIZE="2",
                  EXPERT_MODEL_PARALLEL_SIZE="2", SAVE_INTERVAL="2", EVAL_INTERVAL="2", EVAL_ITERS="1", SPLIT="90,8,2",
                  WANDB_API_KEY="offline", WANDB_MODE="disabled")  # the script's wandb flags, as written; not its service
    args = ["ckpt", tokenizer, "processed_data_text_document"]
    first = _launch("train_mixtral_8x7b_distributed.sh", args, tmp_path, {**shrunk, "TRAIN_ITERS": "2"})
    assert _iterations(first) == [1, 2] and "validation loss" in first
    second = _launch("train_mixtral_8x7b_distributed.sh", args, tmp_path, {**shrunk, "TRAIN_ITERS": "4"})
    assert _iterations(second) == [3, 4]
    assert ("carried: model weights, iteration 2; reset: optimizer state (--no-load-optim), LR schedule (starts again "
            "from its first step), random streams") in second
    assert (tmp_path / "ckpt" / "latest").read_text() == "global_step4"
    written = _written_config(tmp_path / "ckpt")
    assert written["adam-beta2"] == 0.999 and written["adam-beta1"] == 0.9, "left out: Megatron's Adam betas"
    assert written["moe-token-dispatcher-type"] == "alltoall" and written["moe-router-load-balancing-type"] == "aux_loss"
    assert (written["group-query-attention"], written["num-query-groups"], written["wandb-name"]) == (True, 2, "Mixtral_8x7B")
    assert (written["load-optim"], written["load-rng"], written["use-distributed-optimizer"]) == (False, False, True)


def test_gpt3_175b_script_trains_a_gpt3_block_with_megatrons_defaults_saves_and_resumes(tmp_path):
    corpus_jsonl(str(tmp_path / "my-corpus.json"))
    vocab, merges = gpt2_vocab_and_merges(str(tmp_path))
    os.replace(vocab, tmp_path / "gpt2-vocab.json")
    os.replace(merges, tmp_path / "gpt2-merges.txt")
    # the guide's GPT command (seeds/004), as written
    _preprocess(tmp_path, "--input", "my-corpus.json", "--output-prefix", "my-gpt2", "--vocab-file", "gpt2-vocab.json",
                "--tokenizer-type", "GPT2BPETokenizer", "--merge-file", "gpt2-merges.txt", "--append-eod")
    shrunk = dict(GPUS_PER_NODE="2", NUM_LAYERS="2", HIDDEN_SIZE="64", NUM_ATTENTION_HEADS="4", SEQ_LENGTH="64",
                  MAX_POSITION_EMBEDDINGS="64", GLOBAL_BATCH_SIZE="4", LR_DECAY_ITERS="8", PRECISION=" ",
                  TENSOR_MODEL_PARALLEL_SIZE="1", PIPELINE_MODEL_PARALLEL_SIZE="2", SPLIT="80,15,5", LOG_INTERVAL="1",
                  SAVE_INTERVAL="2", EVAL_INTERVAL="2", EVAL_ITERS="1")
    args = ["ckpt", "tb", "gpt2-vocab.json", "gpt2-merges.txt", "my-gpt2_text_document"]
    first = _launch("train_gpt3_175b_distributed.sh", args, tmp_path, {**shrunk, "TRAIN_ITERS": "2"})
    second = _launch("train_gpt3_175b_distributed.sh", args, tmp_path, {**shrunk, "TRAIN_ITERS": "4"})
    assert (_iterations(first), _iterations(second)) == ([1, 2], [3, 4])
    written = _written_config(tmp_path / "ckpt")
    # what the script leaves out is Megatron-LM's: a GPT-3 block, not the project's Llama block
    assert (written["normalization"], written["position-embedding-type"], written["swiglu"], written["add-bias-linear"]) == \
        ("LayerNorm", "learned_absolute", False, True)
    assert (written["hidden-dropout"], written["attention-dropout"], written["ffn-hidden-size"]) == (0.1, 0.1, 4 * 64)
    assert (written["lr-warmup-fraction"], written["adam-beta2"], written["tokenizer-type"]) == (0.001, 0.95, "GPT2BPETokenizer")
    assert os.listdir(tmp_path / "tb"), "no TensorBoard scalars written"


def test_llama3_8b_script_trains_on_mock_data_saves_resumes_and_profiles(tmp_path):
    shrunk = dict(GPUS_PER_NODE="2", DTYPE="bf16", ATTENTION_BACKEND="auto", NUM_LAYERS="2", HIDDEN_SIZE="64",
                  FFN_HIDDEN_SIZE="128", NUM_ATTENTION_HEADS="4", NUM_QUERY_GROUPS="2", KV_CHANNELS="16", SEQ_LENGTH="64",
                  MAX_POSITION_EMBEDDINGS="64", GLOBAL_BATCH_SIZE="4", LR_DECAY_SAMPLES="30", LR_WARMUP_SAMPLES="6",
                  VOCAB_SIZE="512", EVAL_ITERS="1", EVAL_INTERVAL="2", SAVE_INTERVAL="2", DATA_CACHE_PATH=str(tmp_path / "cache"))
    first = _launch("train_llama3_8b_h100_fp8.sh", ["ckpt", "tb"], tmp_path, {**shrunk, "TRAIN_SAMPLES": "16"})
    second = _launch("train_llama3_8b_h100_fp8.sh", ["ckpt", "tb"], tmp_path, {**shrunk, "TRAIN_SAMPLES": "24"})
    assert (_iterations(first), _iterations(second)) == ([1, 2, 3, 4], [5, 6])
    assert "--ckpt-format torch_dist: checkpoints are DeepSpeed's" in first
    assert sorted(os.listdir(tmp_path / "profile")) == ["trace_rank0_steps4-6.json", "trace_rank1_steps4-6.json"]
    written = _written_config(tmp_path / "ckpt")
    # the iterations are derived from --train-samples (so a reuse with another batch derives its own): not written
    assert (written.get("train-iters"), written["train-samples"], written["mock-data"], written["tokenizer-type"],
            written["apply-layernorm-1p"]) == (None, 24, True, "NullTokenizer", True)
    assert (written["decoupled-lr"], written["group-query-attention"], written["kv-channels"]) == (5.0e-4, True, 16)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or importlib.util.find_spec("transformer_engine") is None,
                    reason="the FP8 script as written needs a CUDA GPU with Transformer Engine")
def test_llama3_8b_fp8_script_as_written_trains_saves_and_resumes_on_one_gpu(tmp_path):
    """Every FP8 flag as the script has it (hybrid, amax 1024/max, --fp8-param-gather, fused attention,
    seq 8192, mock data), on one GPU with the 8B block cut to 4 layers and a 32768 vocabulary so that
    two checkpoints fit the machine's disk."""
    shrunk = dict(GPUS_PER_NODE="1", NUM_LAYERS="4", VOCAB_SIZE="32768", GLOBAL_BATCH_SIZE="8", LR_WARMUP_SAMPLES="16",
                  LR_DECAY_SAMPLES="160", EVAL_ITERS="2", EVAL_INTERVAL="10", SAVE_INTERVAL="1000",
                  DATA_CACHE_PATH=str(tmp_path / "cache"))
    first = _launch("train_llama3_8b_h100_fp8.sh", ["ckpt", "tb"], tmp_path, {**shrunk, "TRAIN_SAMPLES": "80"}, on_gpu=True)
    second = _launch("train_llama3_8b_h100_fp8.sh", ["ckpt", "tb"], tmp_path, {**shrunk, "TRAIN_SAMPLES": "160"}, on_gpu=True)
    assert (_iterations(first), _iterations(second)) == (list(range(1, 11)), list(range(11, 21)))
    written = _written_config(tmp_path / "ckpt")
    assert (written["fp8-format"], written["transformer-impl"], written["attention-backend"]) == \
        ("hybrid", "transformer_engine", "cudnn")
    assert (written["fp8-amax-history-len"], written["fp8-amax-compute-algo"], written["seq-length"]) == (1024, "max", 8192)
