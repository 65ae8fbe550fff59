"""GRPO's reward functions, loaded by name (``--reward-funcs``), and how they are called.

The calling convention is TRL's (``GRPOTrainer``'s reward functions, TRL 1.16.0), so a function
written for TRL works here unchanged: keyword arguments

    prompts         each completion's prompt as the data gave it: a string, or a list of messages
    completions     each completion's text; for a conversational prompt (messages), a list holding one
                    message {"role": "assistant", "content": text}, as TRL passes it
    completion_ids  each completion's token ids (the stop token, when one ended it, included)
    <column>        every other column of the prompts file, one value per completion (a prompt's
                    value repeated for each of its --num-generations completions)

and a list of one float per completion back, or None for one the function cannot score (it then
takes no part in that function's statistics, and a completion no function scores gets advantage 0,
as in TRL). A function should take ``**kwargs`` for the columns it does not read.

Built-ins: ``accuracy`` (the completion's final answer against the ``solution`` column, parsed and
compared by math-verify: LaTeX or plain expressions, a \\boxed{} answer first; None where the
solution itself does not parse) and ``format`` (1 when the completion matches ``--format-pattern``
from its start, dot matching newlines, else 0). A user function is ``path/to/file.py:name`` or
``module:name``; it is loaded before any process group, so a typo fails in one sentence.
"""
from __future__ import annotations

import importlib
import importlib.util
import os
import re
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from ..config import ConfigError, PostTrainConfig

DEFAULT_FORMAT_PATTERN = PostTrainConfig.format_pattern  # reasoning in one <think> block, then the answer


class RewardError(RuntimeError):
    """A reward function that returned something other than one number (or None) per completion."""


@dataclass(frozen=True)
class RewardFunction:
    name: str  # for the log: rewards/<name>/mean
    fn: Callable


def completion_text(completion) -> str:
    """The text of a completion as either convention passes it (a string, or [{"content": ...}])."""
    return completion if isinstance(completion, str) else completion[0]["content"]


def accuracy(completions, solution, **kwargs) -> list:
    """1.0 when the completion's answer equals ``solution`` by math-verify, 0.0 when not, None when the
    solution cannot be parsed (nothing to compare against)."""
    from math_verify import parse, verify
    rewards = []
    for completion, gold_text in zip(completions, solution, strict=True):
        gold = parse(str(gold_text))
        rewards.append(float(verify(gold, parse(completion_text(completion)))) if gold else None)
    return rewards


def format_reward(pattern: str) -> Callable:
    compiled = re.compile(pattern, re.DOTALL)

    def format(completions, **kwargs) -> list:  # noqa: A001 - the name the log shows
        return [1.0 if compiled.match(completion_text(c)) else 0.0 for c in completions]
    return format


def _load_user_function(spec: str) -> Callable:
    """``path/to/file.py:name`` or ``module:name`` -> the callable (ConfigError naming the spec)."""
    where, _, name = spec.rpartition(":")
    flag = f"--reward-funcs {spec}"
    if where.endswith(".py"):
        if not os.path.isfile(where):
            raise ConfigError(f"{flag}: no such file {where}.")
        module_name = "hybridlm_reward_" + os.path.splitext(os.path.basename(where))[0]
        loader = importlib.util.spec_from_file_location(module_name, where)
        module = importlib.util.module_from_spec(loader)
        load = lambda: loader.loader.exec_module(module)  # noqa: E731
    else:
        module = None
        load = lambda: importlib.import_module(where)  # noqa: E731
    try:
        loaded = load()
    except Exception as e:  # noqa: BLE001 - the user's code: say which file and what it raised
        first = str(e).splitlines()[0] if str(e) else ""
        raise ConfigError(f"{flag}: importing {where} raised {type(e).__name__}: {first}.") from None
    module = module if module is not None else loaded
    fn = getattr(module, name, None)
    if not callable(fn):
        raise ConfigError(f"{flag}: {where} has no function named '{name}'.")
    return fn


def load_reward_functions(specs: Sequence[str], format_pattern: str = DEFAULT_FORMAT_PATTERN) -> list[RewardFunction]:
    """The functions ``--reward-funcs`` names, in order."""
    functions = []
    for spec in specs:
        if spec == "accuracy":
            if importlib.util.find_spec("math_verify") is None:
                raise ConfigError("--reward-funcs accuracy needs math-verify (pip install math-verify, or the package's "
                                  "[post] extra).")
            functions.append(RewardFunction("accuracy", accuracy))
        elif spec == "format":
            try:
                functions.append(RewardFunction("format", format_reward(format_pattern)))
            except re.error as e:
                raise ConfigError(f"--format-pattern {format_pattern!r} is not a regular expression ({e}).") from None
        elif ":" in spec:
            fn = _load_user_function(spec)
            functions.append(RewardFunction(getattr(fn, "__name__", spec.rpartition(":")[2]), fn))
        else:
            raise ConfigError(f"--reward-funcs {spec}: not a built-in (accuracy, format) nor a user function "
                              "written path/to/file.py:name or module:name.")
    return functions


def score(functions: Sequence[RewardFunction], *, prompts: list, completions: list, completion_ids: list,
          columns: dict) -> np.ndarray:
    """[completions, functions] rewards (float64; NaN where a function returned None)."""
    rewards = np.full((len(completions), len(functions)), np.nan)
    for j, function in enumerate(functions):
        values = function.fn(prompts=prompts, completions=completions, completion_ids=completion_ids, **columns)
        if not isinstance(values, (list, tuple, np.ndarray)) or len(values) != len(completions):
            got = f"{len(values)} values" if hasattr(values, "__len__") else f"a {type(values).__name__}"
            raise RewardError(f"reward function {function.name} returned {got} for {len(completions)} completions; it must "
                              "return one number (or None) per completion.")
        for i, value in enumerate(values):
            if value is None:
                continue
            if not isinstance(value, (bool, int, float, np.floating, np.integer)):
                raise RewardError(f"reward function {function.name} returned {value!r} for completion {i}; rewards are "
                                  "numbers, or None for a completion it cannot score.")
            rewards[i, j] = float(value)  # NaN, like None, leaves it unscored
    return rewards
