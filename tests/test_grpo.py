"""GRPO: the loss and gradients at every layout equal TRL 1.16.0's definitions on transformers'
log-probabilities (fixed rollouts: prompts, completions, rewards, old and reference log-probs),
for each loss type, reward scaling and truncation mask; rollouts, resumes and a learning run."""
from __future__ import annotations

import pytest
import torch

from finetune_runs import as_hf_names, hf_model
from grpo_runs import (FROZEN, completion_logps, fixed_rollouts, model_and_prompts, run_flags, train_on_fixed_rollouts,
                       trl_advantages, trl_loss, with_logps)
from harness import run_ranks
from oracle import ds_config, relative_error

VARIANTS = [("grpo", "group", False), ("bnpo", "batch", False), ("dr_grpo", "none", False), ("dapo", "group", True),
            ("grpo", "batch", True)]
LAYOUTS = {
    "tp2_sp_dp2_zero1": (4, ["--tensor-model-parallel-size", "2", "--sequence-parallel"] + ds_config("zero1")),
    "dp2_zero3": (2, ds_config("zero3")),
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
