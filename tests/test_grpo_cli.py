"""GRPO through scripts/finetune.py: a run logs its rewards, KL, clipping, lengths and both rates,
saves, and exports to Hugging Face as SFT does; bad input is one sentence and exit code 2 before any
process group exists."""
from __future__ import annotations

import json

import pytest

from grpo_runs import even_tokens, model_and_prompts
from harness import run_ranks
from oracle import ds_config
from test_finetune_cli import finetune_main, script

LOGGED = ("rewards/even_tokens/mean", "rewards/even_tokens/std", "rewards/format/mean", "reward", "reward_std", "kl",
          "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean", "completions/mean_length",
          "completions/max_length", "completions/clipped_ratio", "rollout_tokens_per_sec", "train_tokens_per_sec",
          "completions_per_sec", "rollout_seconds", "train_seconds")


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("grpo_cli")
    _, ckpt, prompts = model_and_prompts(root)
    bad = {"BAD_JSON": ['{"prompt": "a"}', '{"prompt": "b"'],
           "ENDS_WITH_REPLY": ['{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}'],
           "NO_SOLUTION": ['{"prompt": "1 + 1", "solution": "2"}', '{"prompt": "2 + 2"}']}
    paths = {"CKPT": ckpt, "PROMPTS": prompts, "REWARD": even_tokens(root)}
    for name, lines in bad.items():
        paths[name] = str(root / f"{name.lower()}.jsonl")
        with open(paths[name], "w") as f:
            f.write("\n".join(lines) + "\n")
    return paths


def test_grpo_through_finetune_py_logs_saves_and_exports(files, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    argv = ["--task", "grpo", "--load", files["CKPT"], "--data-path", files["PROMPTS"], "--reward-funcs", files["REWARD"], "format",
            "--reward-weights", "1", "0.5", "--num-generations", "4", "--max-completion-length", "6", "--beta", "0.04",
            "--tensor-model-parallel-size", "2", "--micro-batch-size", "4", "--global-batch-size", "8", "--train-iters", "2",
            "--log-interval", "1", "--save", str(tmp_path / "run"), "--metrics-file", str(tmp_path / "metrics.jsonl")] + ds_config("zero1")
    assert [code for code, _, _ in run_ranks(2, finetune_main, argv, timeout=300)] == [0, 0]
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == 2 and all(set(LOGGED) <= set(r) for r in records), set(LOGGED) - set(records[0])
    assert all(r["rollout_tokens_per_sec"] > 0 and r["train_tokens_per_sec"] > 0 and 1 <= r["completions/max_length"] <= 6
               for r in records)
    assert script("convert_to_hf").main(["--checkpoint", str(tmp_path / "run"), "--output", str(tmp_path / "hf"), "--no-progress"]) == 0
    tokenizer = AutoTokenizer.from_pretrained(str(tmp_path / "hf"), local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), local_files_only=True)
    eos = model.generation_config.eos_token_id
    assert tokenizer.chat_template and tokenizer.convert_tokens_to_ids("<|im_end|>") in (eos if isinstance(eos, list) else [eos])


REFUSALS = [
    pytest.param(2, ["--pipeline-model-parallel-size", "2"], "--task grpo cannot be combined with --pipeline-model-parallel-size 2: "
                 "rollouts decode one token at a time", id="pipeline_parallel"),
    pytest.param(2, ["--micro-batch-size", "2", "--global-batch-size", "12"], "it must be a multiple of 4 x 2",
                 id="groups_across_replicas"),
    pytest.param(1, ["--reward-funcs", "acuracy"], "--reward-funcs acuracy: not a built-in", id="misspelt_reward"),
    pytest.param(1, ["--reward-weights", "1", "2"], "--reward-weights gives 2 weights for 1 --reward-funcs", id="weights_count"),
    pytest.param(1, ["--data-path", "BAD_JSON"], "bad_json.jsonl:2: malformed JSON", id="bad_line"),
    pytest.param(1, ["--data-path", "ENDS_WITH_REPLY"], "ends_with_reply.jsonl:1: 'messages' ends with an assistant reply",
                 id="prompt_with_its_reply"),
    pytest.param(1, ["--data-path", "NO_SOLUTION", "--reward-funcs", "accuracy"],
                 "no_solution.jsonl:2: no 'solution' column, which the accuracy reward reads", id="accuracy_without_solution"),
    pytest.param(1, ["--max-completion-length", "125"], "more than the 3 --seq-length 128 leaves beside --max-completion-length 125",
                 id="prompt_too_long"),
    pytest.param(1, ["--max-completion-length", "128"], "--max-completion-length 128 leaves no room for a prompt", id="no_room"),
    pytest.param(1, ["--epsilon-high", "-1"], "--epsilon-high must be non-negative, got -1.0", id="negative_clip"),
]


@pytest.mark.parametrize("world, extra, message", REFUSALS)
def test_bad_grpo_input_is_one_sentence_before_any_process_group(files, world, extra, message):
    argv = ["--task", "grpo", "--load", files["CKPT"], "--data-path", files["PROMPTS"], "--reward-funcs", files["REWARD"],
            "--num-generations", "4", "--max-completion-length", "8", "--micro-batch-size", "4", "--global-batch-size", "8"]
    argv += ds_config("zero1") + [files.get(a, a) for a in extra]
    for code, err, initialized in run_ranks(world, finetune_main, argv):
        lines = err.strip().splitlines()
        assert code == 2 and not initialized and lines[-1].startswith("error: ") and message in lines[-1], err


def test_grpo_settings_need_task_grpo(files):
    argv = ["--task", "pretrain", "--beta", "0.1"] + ds_config("zero1")
    from hybridlm.config import ConfigError, parse_args
    with pytest.raises(ConfigError, match="--beta needs --task grpo"):
        parse_args(argv).validate(1)
