"""GRPO's reward functions: the built-ins score what they say, user functions load by path or
module and receive the prompts file's columns (TRL's calling convention), and every bad spec or
bad return value is one sentence naming it."""
from __future__ import annotations

import sys

import numpy as np
import pytest

from hybridlm.config import ConfigError
from hybridlm.training.rewards import RewardError, load_reward_functions, score


def _score(specs, completions, **columns):
    return score(load_reward_functions(specs), prompts=["p"] * len(completions), completions=completions,
                 completion_ids=[[1]] * len(completions), columns=columns)


def test_accuracy_compares_final_answers_by_math_verify_and_skips_unparseable_solutions():
    completions = [r"so it is \boxed{\frac{1}{3}}", "It is $1/3$.", "answer: 0.5", "no idea",
                   [{"role": "assistant", "content": r"\boxed{42}"}], "42"]
    solution = [r"\frac{1}{3}", "1/3", "1/3", "1/3", "42", "not a number at all"]
    got = _score(["accuracy"], completions, solution=solution)[:, 0]
    assert got[:5].tolist() == [1.0, 1.0, 0.0, 0.0, 1.0] and np.isnan(got[5])


def test_format_matches_the_pattern_from_the_start_across_lines():
    completions = ["<think>\nsteps\n</think>\nanswer", "answer <think>x</think>", "<think>a</think><think>b</think>"]
    assert _score(["format"], completions)[:, 0].tolist() == [1.0, 0.0, 0.0]
    custom = load_reward_functions(["format"], r"\d+$")
    assert score(custom, prompts=["p"] * 2, completions=["12", "x1"], completion_ids=[[1]] * 2, columns={})[:, 0].tolist() == [1.0, 0.0]


def test_user_functions_load_by_file_or_module_and_receive_the_columns(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(
        "def by_length(prompts, completions, completion_ids, target, **kwargs):\n"
        "    return [1.0 if len(ids) == t else None for ids, t in zip(completion_ids, target)]\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "my_rewards", raising=False)
    for spec in (f"{tmp_path}/my_rewards.py:by_length", "my_rewards:by_length"):
        functions = load_reward_functions([spec])
        assert functions[0].name == "by_length"
        got = score(functions, prompts=["a", "b"], completions=["x", "y"], completion_ids=[[1, 2], [3]], columns={"target": [2, 2]})
        assert got[0, 0] == 1.0 and np.isnan(got[1, 0])


@pytest.mark.parametrize("spec, message", [
    ("acuracy", "--reward-funcs acuracy: not a built-in (accuracy, format)"),
    ("missing/file.py:f", "--reward-funcs missing/file.py:f: no such file missing/file.py."),
    ("json:no_such_function", "--reward-funcs json:no_such_function: json has no function named 'no_such_function'."),
    ("no_such_module_xyz:f", "importing no_such_module_xyz raised ModuleNotFoundError"),
])
def test_a_bad_reward_spec_is_one_sentence(spec, message):
    with pytest.raises(ConfigError) as e:
        load_reward_functions([spec])
    assert message in str(e.value) and "\n" not in str(e.value)


def test_a_bad_format_pattern_is_one_sentence():
    with pytest.raises(ConfigError, match=r"--format-pattern '\(' is not a regular expression"):
        load_reward_functions(["format"], "(")


def test_a_reward_function_returning_the_wrong_count_or_type_is_named(tmp_path):
    (tmp_path / "bad.py").write_text("def short(completions, **kw):\n    return [1.0]\n"
                                     "def text(completions, **kw):\n    return ['good'] * len(completions)\n")
    with pytest.raises(RewardError, match="reward function short returned 1 values for 2 completions"):
        score(load_reward_functions([f"{tmp_path}/bad.py:short"]), prompts=["p"] * 2, completions=["a", "b"],
              completion_ids=[[1], [2]], columns={})
    with pytest.raises(RewardError, match="reward function text returned 'good' for completion 0"):
        score(load_reward_functions([f"{tmp_path}/bad.py:text"]), prompts=["p"] * 2, completions=["a", "b"],
              completion_ids=[[1], [2]], columns={})
