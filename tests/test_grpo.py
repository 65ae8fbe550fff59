"""GRPO: the loss and gradients at every layout equal TRL 1.16.0's definitions on transformers'
log-probabilities (computed with the output head fused into the loss, hybridlm/parallel/fused_head.py) (fixed rollouts: prompts, completions, rewards, old and reference log-probs),
for each loss type, reward scaling and truncation mask; rollouts, resumes and a learning run."""
from __future__ import annotations

import os

import pytest
import torch

from finetune_runs import as_hf_names, hf_model
from grpo_runs import (FROZEN, completion_logps, even_tokens, fixed_rollouts, graphed_rollout_then_step, model_and_prompts,
                       rollout_then_step, run_flags, train_on_fixed_rollouts, train_steps, transformers_rollouts, trl_advantages,
                       trl_loss, with_logps)
from harness import run_ranks
from oracle import ds_config, relative_error

VARIANTS = [("grpo", "group", False), ("bnpo", "batch", False), ("dr_grpo", "none", False), ("dapo", "group", True),
            ("grpo", "batch", True)]
LAYOUTS = {
    "tp2_sp_dp2_zero1": (4, ["--tensor-model-parallel-size", "2", "--sequence-parallel"] + ds_config("zero1")),
    "dp2_zero3": (2, ds_config("zero3")),
    "dp2_zero2": (2, ds_config("zero2")),
    "cp2_zero1": (2, ["--context-parallel-size", "2"] + ds_config("zero1")),
}


@pytest.fixture(scope="module")
def pinned(tmp_path_factory):
    """The fixed rollouts, and per variant TRL's loss and gradients on transformers' model."""
    directory = tmp_path_factory.mktemp("grpo")
    hf_dir, checkpoint, _ = model_and_prompts(directory)
    model = hf_model(hf_dir)
    data = with_logps(fixed_rollouts(), completion_logps(model, fixed_rollouts(), 0.7))
    rewards = torch.tensor(data["rewards"], dtype=torch.float32)
    expected = []
    for loss_type, scale, mask_truncated in VARIANTS:
        model.zero_grad()
        advantages = trl_advantages(rewards, torch.ones(2), 4, scale)
        loss = trl_loss(completion_logps(model, data, 0.7), data, advantages, loss_type=loss_type, mask_truncated=mask_truncated,
                        beta=0.04, epsilon=0.2, epsilon_high=0.28, longest=8, micro_batch=2, processes=2)
        loss.backward()
        expected.append({"loss": loss.item(), "grads": {n: p.grad.clone() for n, p in model.named_parameters()}})
    return directory, checkpoint, data, expected


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_loss_and_gradients_equal_trls_definitions_for_every_loss_type(pinned, layout):
    directory, checkpoint, data, expected = pinned
    world, flags = LAYOUTS[layout]
    got = run_ranks(world, train_on_fixed_rollouts, run_flags(directory, *FROZEN, *flags), data, VARIANTS, timeout=400)[0]
    for (loss_type, scale, masked), want, ours in zip(VARIANTS, expected, got):
        what = f"{loss_type} loss, {scale} scaling{', truncated masked' if masked else ''}"
        assert abs(ours["loss"] - want["loss"]) <= 1e-5 * abs(want["loss"]), f"{what}: loss {ours['loss']!r} != {want['loss']!r}"
        grads = as_hf_names(ours["grads"], checkpoint)
        for name, grad in want["grads"].items():
            err = relative_error(grads[name], grad)
            assert err <= 1e-5, f"{what}: {name} gradient relative error {err:.2e}"
    losses = [r["loss"] for r in expected]
    assert len(set(round(x, 6) for x in losses)) == len(losses), "the variants should differ, or the test shows nothing"
    assert got[-1]["fused_head_calls"] >= 2 * len(VARIANTS), "the log-probabilities came from the head fused into the loss"


PROMPTS = [[5, 77, 140], [9, 12, 250, 3, 299, 18, 64], [200, 41, 7, 7, 150, 33]]


@pytest.mark.parametrize("layout", ["tp2_sp_dp2_zero1", "dp2_zero3"])
def test_rollouts_on_the_training_weights_are_transformers_generate(tmp_path_factory, layout):
    # --top-k 1 samples the argmax; under ZeRO-3 the rollout gathers the weights and lifts DeepSpeed's
    # hooks, and the training step after it must find them in place again
    directory = tmp_path_factory.getbasetemp() / "grpo_rollouts"
    hf_dir, _, _ = model_and_prompts(directory, initializer_range=0.3)  # not near-ties: greedy is well defined
    world, flags = LAYOUTS[layout]
    got = run_ranks(world, rollout_then_step, run_flags(directory, "--top-k", "1", "--train-iters", "1", *flags), PROMPTS,
                    timeout=400)
    assert all(g["tokens"] == got[0]["tokens"] for g in got), "every rank must decode the same rows"
    _assert_transformers_rollouts(got, hf_dir)


def _assert_transformers_rollouts(got: list[dict], hf_dir: str) -> None:
    """Rank 0's rollouts of PROMPTS are transformers' greedy ones (cut at the stop tokens) and every rank then trained."""
    stops = got[0]["stops"]
    theirs = transformers_rollouts(hf_dir, PROMPTS, stops)
    assert all(len(set(row)) > 2 for row in theirs), "a degenerate continuation would not test much"
    assert got[0]["tokens"] == theirs
    assert got[0]["truncated"] == [len(row) == 8 and row[-1] not in stops for row in theirs]
    assert all(torch.isfinite(torch.tensor(g["loss"])) for g in got)


def _loading(flags: list[str], directory) -> list[str]:
    """``flags`` with --load pointing at ``directory`` (a GRPO run to resume) instead of the imported model."""
    at = flags.index("--load")
    return flags[:at + 1] + [str(directory)] + flags[at + 2:]


def test_a_resumed_run_continues_bit_for_bit_mid_rollout_with_its_reference(pinned, tmp_path):
    # two steps per rollout: the save after step 1 falls inside a rollout batch, which must come back
    # with the rollout stream; the reference is the imported start, frozen again from its folder
    directory, checkpoint, _, _ = pinned
    flags = run_flags(directory, "--reward-funcs", even_tokens(directory), "--num-iterations", "2", "--train-iters", "4",
                      *ds_config("zero3"))
    straight = run_ranks(2, train_steps, flags, 4, timeout=400)[0]
    first = run_ranks(2, train_steps, flags + ["--save", str(tmp_path / "run")], 1, True, timeout=400)[0]
    resumed = run_ranks(2, train_steps, _loading(flags, tmp_path / "run"), 3, timeout=400)[0]
    assert first["losses"] == straight["losses"][:1] and resumed["losses"] == straight["losses"][1:]
    assert [r.get("reward") for r in resumed["records"]] == [r.get("reward") for r in straight["records"][1:]]
    assert [("reward" in r) for r in straight["records"]] == [True, False, True, False]  # a rollout every other step
    for name, tensor in straight["weights"].items():
        assert torch.equal(resumed["weights"][name], tensor), name
    assert straight["records"][0]["kl"] == 0.0 < straight["records"][2]["kl"]  # the policy leaves its frozen start
    assert resumed["frozen"] and resumed["reference"] == first["reference"] == os.path.join(checkpoint, "global_step0")
    other_seed = run_ranks(2, train_steps, flags + ["--seed", "5"], 1, timeout=400)[0]
    assert other_seed["records"][0]["reward"] != straight["records"][0]["reward"]


def test_with_lora_the_reference_is_the_base_with_adapters_off(pinned):
    directory, _, _, _ = pinned
    flags = run_flags(directory, "--reward-funcs", even_tokens(directory), "--lora-rank", "4", "--beta", "0.1",
                      "--train-iters", "3", *ds_config("zero1"))
    result = run_ranks(2, train_steps, flags, 3, timeout=400)[0]
    assert not result["frozen"]  # no copy of the weights: the base is the reference
    assert result["records"][0]["kl"] == 0.0 < result["records"][2]["kl"]


def test_a_tiny_model_learns_a_learnable_reward_from_chance(pinned):
    # the reward is the share of even token ids in a completion: 0.5 by chance for a random model; GRPO
    # must move the policy to even tokens within the step budget
    directory, _, _, _ = pinned
    flags = run_flags(directory, "--reward-funcs", even_tokens(directory), "--num-generations", "8", "--max-completion-length", "4",
                      "--micro-batch-size", "16", "--global-batch-size", "32", "--beta", "0", "--temperature", "1",
                      "--lr", "5e-3", "--min-lr", "5e-3", "--clip-grad", "1.0", "--seed", "3", "--train-iters", "40",
                      *ds_config("zero1"))
    rewards = [r["reward"] for r in run_ranks(1, train_steps, flags, 40, timeout=400)[0]["records"]]
    assert 0.35 < sum(rewards[:3]) / 3 < 0.65, rewards
    assert sum(rewards[-5:]) / 5 >= 0.8, rewards


# ---------------------------------------------------------------- on the GPU machine (pytest -m gpu)

@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (CUDA graphs)")
@pytest.mark.parametrize("layout", ["zero3", "lora"])
def test_graphed_rollouts_on_one_gpu_under_zero3_and_lora_are_transformers_generate(tmp_path_factory, layout):
    # the decode step replayed from CUDA graphs on the live training weights: under ZeRO-3 the graphs read the weights
    # gathered for the rollout, with LoRA the adapters' extra products (zero at the start: the base's rollouts); the step
    # after the rollout must find the engine as it was. fp32 (no TF32): the rows are transformers' exactly
    directory = tmp_path_factory.getbasetemp() / "grpo_rollouts"
    hf_dir, _, _ = model_and_prompts(directory, initializer_range=0.3)
    flags = ds_config("zero3") if layout == "zero3" else ["--lora-rank", "4", *ds_config("zero1")]
    # a spawned rank: a forked one cannot use CUDA once the test process has asked torch.cuda.is_available()
    # the project's own reward: the GPU machine has no math-verify for the shared flags' accuracy reward
    flags = run_flags(directory, "--reward-funcs", even_tokens(directory), "--top-k", "1", "--train-iters", "1", *flags)
    got = run_ranks(1, graphed_rollout_then_step, flags, PROMPTS, timeout=400, start_method="spawn")
    assert got[0]["captured"], "the rollout's decode step was not captured as a CUDA graph"
    _assert_transformers_rollouts(got, hf_dir)
