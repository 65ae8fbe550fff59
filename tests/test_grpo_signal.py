"""GRPO runs that cannot learn say so (issue 47, item 5): a rollout batch whose rewards carry no signal (every
group's rewards equal, none scored, every completion masked as truncated) is named once, by its reason, instead
of steps logging loss 0 and gradient norm 0 as if all were well; a reward function returning the wrong count or
type stops the run in one sentence at start-up, before the model loads."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from harness import run_ranks
from oracle import ds_config
from test_finetune_cli import finetune_main
from test_grpo_cli import files  # noqa: F401 - the fixture: a small imported model and a prompts file

NAN = float("nan")


def _reason(rewards: list, truncated: list, mask_truncated: bool = False):
    from hybridlm.training.grpo import advantages_of, no_signal_reason, signal_counts
    rewards = np.array(rewards, dtype=np.float64)[:, None]
    advantages, weighted = advantages_of(rewards, np.ones(1), 2, "group", dp=None)
    return no_signal_reason(signal_counts(weighted, advantages, truncated, mask_truncated))


@pytest.mark.parametrize("rewards, truncated, mask, reason", [
    pytest.param([1.0, 1.0, 0.0, 0.0], [False] * 4, False, "every group's completions got equal rewards", id="groups_equal"),
    pytest.param([NAN, NAN, NAN, NAN], [False] * 4, False, "no reward function scored any of the 4 completions", id="unscored"),
    pytest.param([1.0, 0.0, 0.0, 1.0], [True] * 4, True, "all 4 completions were truncated and --mask-truncated-completions",
                 id="all_masked"),
    pytest.param([1.0, NAN, 0.5, 0.5], [False] * 4, False, "every group's completions got equal rewards", id="one_scored_per_group"),
])
def test_a_rollout_batch_without_signal_is_named_by_its_reason(rewards, truncated, mask, reason):
    assert reason in _reason(rewards, truncated, mask)


def test_a_rollout_batch_with_one_group_that_differs_carries_signal():
    assert _reason([1.0, 1.0, 0.0, 1.0], [False, False, False, True], mask_truncated=True) is None
    assert _reason([1.0, 1.0, 0.0, 1.0], [False] * 4) is None


def test_the_warning_is_said_once_per_reason(capsys):
    from hybridlm.training.grpo import warn_if_no_signal
    run, warned = SimpleNamespace(ps=SimpleNamespace(dp=SimpleNamespace(size=1)), iteration=4), set()
    for _ in range(3):
        warn_if_no_signal(run, [4, 4, 4, 0], warned)
    warn_if_no_signal(run, [4, 0, 4, 0], warned)
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2 and "iteration 5 carries no learning signal: every group's" in lines[0] and "scored" in lines[1]


@pytest.mark.parametrize("body, message", [
    pytest.param("return [1.0]", "reward function bad returned 1 values for 4 completions", id="count"),
    pytest.param("return ['good'] * len(completions)", "reward function bad returned 'good' for completion 0", id="type"),
    pytest.param("return len(completions)", "reward function bad returned a int for 4 completions", id="not_a_list"),
])
def test_a_reward_function_returning_the_wrong_count_or_type_stops_the_run_before_the_model_loads(files, tmp_path, body,  # noqa: F811
                                                                                                  message):
    (tmp_path / "bad.py").write_text(f"def bad(completions, **kwargs):\n    {body}\n")
    argv = ["--task", "grpo", "--load", files["CKPT"], "--data-path", files["PROMPTS"], "--reward-funcs", f"{tmp_path}/bad.py:bad",
            "--num-generations", "4", "--max-completion-length", "8", "--micro-batch-size", "4", "--global-batch-size", "8",
            "--train-iters", "1"] + ds_config("zero1")
    code, err, initialized = run_ranks(1, finetune_main, argv)[0]
    last = err.strip().splitlines()[-1]
    assert (code, initialized) == (2, False) and last.startswith("error: --reward-funcs: ") and message in last, err
    assert "called at start-up on 4 made-up completions of the first prompt" in last
