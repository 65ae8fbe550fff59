"""A checkpoint continues at another parallel layout: model weights always, and the optimizer
state (fp32 master, Adam moments, step) across TP, PP, DP, EP and ZeRO stages, so the next
steps' losses equal those of continuing unchanged (fp32, CPU). Expert-parallel checkpoints
resume exactly. What was carried and what was reset is said in one log line."""
from __future__ import annotations

import os

import pytest

from harness import run_ranks
from interop_runs import BASE, EP2, MOE, TP2PP2, saved_run, train
from oracle import ds_config
from test_bad_input import _main_on_rank

_continued: dict = {}


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("reshape_runs")


def _continue(directory: str, world: int, layout: list[str], zero: str, extra: tuple = ()) -> dict:
    """Two more steps of ``directory`` (saved at step 2) at another layout; once per session."""
    key = (directory, world, tuple(layout), zero, extra)
    if key not in _continued:
        flags = BASE + layout + ds_config(zero) + list(extra) + ["--train-iters", "4", "--load", directory]
        _continued[key] = run_ranks(world, train, flags, 2)[0]
    return _continued[key]


def _assert_same_losses(got: list[float], want: list[float], tol: float = 1e-5) -> None:
    for step, (g, w) in enumerate(zip(got, want), start=3):
        assert abs(g - w) <= tol * abs(w), f"step {step}: loss {g!r} != {w!r} when continuing unchanged"


@pytest.mark.parametrize("world, layout, zero", [
    pytest.param(4, ["--pipeline-model-parallel-size", "4"], "zero1", id="tp1_pp4"),
    pytest.param(4, [], "zero1", id="dp4_zero1"),
    pytest.param(2, [], "zero3", id="dp2_zero3"),
    pytest.param(2, ["--tensor-model-parallel-size", "2"], "zero0", id="tp2_no_zero"),
])
def test_tp2_pp2_checkpoint_continues_at_another_layout_with_the_same_losses(root, capfd, world, layout, zero):
    directory, saved = saved_run(root, 4, TP2PP2, "zero1")
    unchanged = _continue(directory, 4, TP2PP2, "zero1")
    capfd.readouterr()
    reshaped = _continue(directory, world, layout, zero)
    assert unchanged["start"] == reshaped["start"] == 2
    _assert_same_losses(reshaped["losses"], unchanged["losses"])  # step 3: weights; step 4: the optimizer state too
    log = capfd.readouterr().out
    assert "global_step2 saved at TP=2 PP=2 DP=1 EP=1 ZeRO-1 fp32, loaded at" in log
    assert "carried: model weights, optimizer state (fp32 master weights, Adam moments, step 2), LR schedule and iteration 2" in log


def test_finetune_takes_the_weights_only(root, capfd):
    directory, _ = saved_run(root, 4, TP2PP2, "zero1")
    capfd.readouterr()
    result = run_ranks(1, train, BASE + ds_config("zero1") + ["--train-iters", "1", "--load", directory, "--finetune"], 1)[0]
    assert result["start"] == 0
    assert "reset: optimizer state (--finetune), LR schedule and iteration (start at 0)" in capfd.readouterr().out


def test_expert_parallel_checkpoint_resumes_exactly_and_reshapes(root):
    flags = BASE + MOE + EP2 + ds_config("zero1")
    directory, first = saved_run(root, 2, MOE + EP2, "zero1")
    whole = run_ranks(2, train, flags + ["--train-iters", "4"], 4)[0]
    resumed = _continue(directory, 2, MOE + EP2, "zero1")
    assert first["losses"] + resumed["losses"] == whole["losses"]  # bit for bit: every EP rank got its own experts back
    for name, tensor in whole["weight"].items():
        assert tensor.equal(resumed["weight"][name]), name
    single = _continue(directory, 1, MOE, "zero0")
    _assert_same_losses(single["losses"], whole["losses"][2:])


EP4 = ["--expert-model-parallel-size", "4"]
EXPERT_BIAS = ["--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias", "--moe-router-bias-update-rate", "0.05"]


@pytest.mark.parametrize("world, layout, zero", [
    pytest.param(2, MOE + EP2, "zero1", id="ep2"),
    pytest.param(1, MOE, "zero0", id="ep1"),
])
def test_ep4_checkpoint_continues_at_a_smaller_ep_with_the_same_losses(root, world, layout, zero):
    directory, _ = saved_run(root, 4, MOE + EP4, "zero1")
    unchanged = _continue(directory, 4, MOE + EP4, "zero1")
    _assert_same_losses(_continue(directory, world, layout, zero)["losses"], unchanged["losses"])


def test_expert_bias_resumes_exactly_and_carries_over_to_another_ep(root):
    flags = BASE + MOE + EXPERT_BIAS + EP2 + ds_config("zero1")
    directory, first = saved_run(root, 2, MOE + EXPERT_BIAS + EP2, "zero1")
    whole = run_ranks(2, train, flags + ["--train-iters", "4"], 4)[0]
    resumed = _continue(directory, 2, MOE + EXPERT_BIAS + EP2, "zero1")
    assert first["losses"] + resumed["losses"] == whole["losses"]  # the biases of step 2 came back
    single = _continue(directory, 1, MOE + EXPERT_BIAS, "zero0")
    _assert_same_losses(single["losses"], whole["losses"][2:])


def _other_model_checkpoint(directory) -> None:
    import torch
    from hybridlm.config import parse_args
    from hybridlm.interop.layout import parameter_table
    from hybridlm.interop.writer import write_checkpoint
    run = parse_args(BASE + ["--hidden-size", "32"]).validate(world_size=1)
    table = parameter_table(run.model, 1)
    write_checkpoint(str(directory), run, lambda name: torch.zeros(table[name].full_shape))


def test_loading_a_checkpoint_of_another_model_is_one_sentence_before_any_process_group(tmp_path):
    _other_model_checkpoint(tmp_path / "ckpt")
    code, err = run_ranks(2, _main_on_rank, BASE + ds_config("zero1") + ["--load", str(tmp_path / "ckpt")])[0]
    assert code == 2
    assert err.strip().count("\n") == 0
    assert "was saved for a different model: 0.word_embeddings.weight" in err or "has shape" in err, err
    assert os.listdir(tmp_path / "ckpt" / "global_step0")  # nothing touched
