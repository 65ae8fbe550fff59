"""The fine-tuning workflow through its scripts: a Hugging Face model is imported, fine-tuned on chat
data and exported, and transformers' generate stops at the end-of-turn token; bad input is one
sentence and exit code 2 before any process group exists."""
from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import os

import pytest
import torch

from chat_fixtures import write_jsonl
from finetune_runs import hf_model_dir, imported, preference_data, sft_data
from harness import run_ranks
from oracle import ROOT, ds_config


def script(name: str):
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "scripts", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def finetune_main(argv: list[str]) -> tuple[int, str, bool]:
    """scripts/finetune.py's main on a forked rank: (exit code, stderr, whether a process group was made)."""
    import torch.distributed as dist

    from hybridlm.training.finetune import main
    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr):
        code = main(argv)
    return code, stderr.getvalue(), dist.is_initialized()


def test_hf_model_sft_export_and_generate_stops_at_end_of_turn(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    hf = hf_model_dir(tmp_path / "hf", "qwen2")
    config_path = tmp_path / "hf" / "tokenizer_config.json"  # a base model's eos (<|endoftext|>), not the reply's end
    config = json.loads(config_path.read_text())
    config_path.write_text(json.dumps({**config, "eos_token": "<|endoftext|>"}))
    assert script("convert_from_hf").main(["--hf", hf, "--output", str(tmp_path / "ckpt"), "--seq-length", "64", "--no-progress"]) == 0
    chat = [{"role": "user", "content": "the cat"}, {"role": "assistant", "content": "sat on a mat"}]
    data = write_jsonl(tmp_path / "chat.jsonl", [{"messages": chat}] * 8)
    assert script("preprocess_chat").main(["--input", data, "--output-prefix", str(tmp_path / "data" / "chat"),
                                           "--tokenizer-model", hf, "--no-progress"]) == 0
    argv = ["--task", "sft", "--load", str(tmp_path / "ckpt"), "--data-path", str(tmp_path / "data" / "chat"), "--packing",
            "--pipeline-model-parallel-size", "2", "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "40",
            "--lr", "1e-2", "--min-lr", "1e-2", "--lr-warmup-iters", "0", "--log-interval", "10", "--save", str(tmp_path / "run"),
            "--metrics-file", str(tmp_path / "metrics.jsonl")] + ds_config("zero1")
    assert [code for code, _, _ in run_ranks(2, finetune_main, argv, timeout=300)] == [0, 0]
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["loss"] < 0.1 * records[0]["loss"] and all(r["loss_tokens"] > 0 for r in records)
    assert script("convert_to_hf").main(["--checkpoint", str(tmp_path / "run"), "--output", str(tmp_path / "out"), "--no-progress"]) == 0

    tokenizer = AutoTokenizer.from_pretrained(str(tmp_path / "out"), local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"), local_files_only=True).eval()
    end_of_turn = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert model.generation_config.eos_token_id == [tokenizer.convert_tokens_to_ids("<|endoftext|>"), end_of_turn]
    prompt = tokenizer.apply_chat_template(chat[:1], add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        out = model.generate(**prompt, max_new_tokens=20, do_sample=False)[0, prompt["input_ids"].shape[1]:].tolist()
    assert out[-1] == end_of_turn and len(out) < 20, out
    assert tokenizer.decode(out[:-1]) == "sat on a mat"


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("finetune_cli")
    hf = hf_model_dir(root / "hf", "qwen2")
    other = hf_model_dir(root / "other_hf", "llama")  # another tokenizer
    return {"CKPT": imported(hf, root / "ckpt"), "OTHER_CKPT": imported(other, root / "other_ckpt"),
            "SFT_DATA": sft_data(root / "sft", hf, count=8), "PREF_DATA": preference_data(root / "pref", hf)}


REFUSALS = [
    pytest.param(["--task", "sft", "--load", "OTHER_CKPT", "--data-path", "SFT_DATA"], "whose files differ from --tokenizer-model",
                 id="data_from_another_tokenizer"),
    pytest.param(["--task", "sft", "--load", "CKPT", "--data-path", "SFT_DATA", "--packing", "--attention-backend", "cudnn"],
                 "--attention-backend cudnn cannot keep packed samples apart", id="packing_with_cudnn"),
    pytest.param(["--task", "dpo", "--load", "CKPT", "--data-path", "PREF_DATA", "--packing"], "--packing needs --task sft",
                 id="packing_with_dpo"),
    pytest.param(["--task", "sft", "--load", "CKPT", "--data-path", "PREF_DATA"], "holds preference pairs; train them with --task dpo",
                 id="preference_data_for_sft"),
    pytest.param(["--task", "dpo", "--load", "CKPT", "--data-path", "PREF_DATA", "--seq-length", "8"], "longer than --seq-length 8",
                 id="dpo_prompt_longer_than_sequence"),
    pytest.param(["--task", "pretrain", "--load", "CKPT"], "needs --task sft, --task dpo or --task grpo", id="finetune_without_task"),
    pytest.param(["--task", "sft", "--load", "CKPT"], "--task sft needs --data-path", id="no_data"),
    pytest.param(["--task", "sft", "--load", "CKPT", "--data-path", "SFT_DATA", "--dpo-beta", "0.5"], "--dpo-beta needs --task dpo",
                 id="dpo_flag_for_sft"),
    pytest.param(["--task", "dpo", "--ref-load", "CKPT", "--data-path", "PREF_DATA"], "--task dpo needs --load", id="dpo_without_policy"),
    pytest.param(["--task", "sft", "--data-path", "SFT_DATA"], "name it with --tokenizer-type HuggingFaceTokenizer",
                 id="no_tokenizer_for_chat_data"),
]


@pytest.mark.parametrize("argv, message", REFUSALS)
def test_bad_finetune_input_is_one_sentence_before_any_process_group(inputs, argv, message):
    argv = [inputs.get(a, a) for a in argv] + ds_config("zero1")
    code, err, initialized = run_ranks(1, finetune_main, argv)[0]
    lines = err.strip().splitlines()
    assert code == 2 and not initialized and lines[-1].startswith("error: ") and message in lines[-1], err


@pytest.mark.slow
def test_deepspeed_launcher_runs_finetune_py(inputs, tmp_path):
    from harness import launch_deepspeed
    result = launch_deepspeed(["--num_gpus", "2", "scripts/finetune.py", "--task", "sft", "--load", inputs["CKPT"], "--data-path",
                               inputs["SFT_DATA"], "--packing", "--tensor-model-parallel-size", "2", "--micro-batch-size", "2",
                               "--train-iters", "2", "--log-interval", "1", "--metrics-file", str(tmp_path / "m.jsonl")]
                              + ds_config("zero1"))
    assert result.returncode == 0, result.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert len(records) == 2 and all(r["loss_tokens"] > 0 and r["loss_tokens_per_sec"] > 0 for r in records)
    assert "sft on 8 conversations, packed rows" in result.stdout
