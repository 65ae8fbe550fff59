"""Megatron-LM's --use-precision-aware-optimizer: AdamW's moments stored in bf16 (hybridlm/training/moment_adamw.py).
With fp32 moments it is torch's AdamW step for step; with bf16 moments it stores half the bytes and takes AdamW's
steps to bf16 rounding of the moments; training under ZeRO keeps them bf16 through a checkpoint and resumes bit
for bit; and every combination that cannot work is one sentence before any process group."""
from __future__ import annotations

import pytest
import torch

from harness import run_ranks
from hybridlm.training import moment_adamw
from hybridlm.training.moment_adamw import MomentDtypeAdamW
from oracle import TINY, ds_config


def _params(seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(50, 3, generator=generator).requires_grad_(), torch.randn(7, generator=generator).requires_grad_()]


def _run(make, steps: int = 5) -> list[torch.Tensor]:
    params = _params()
    optimizer = make([{"params": params[:1], "weight_decay": 0.1}, {"params": params[1:], "weight_decay": 0.0}])
    generator = torch.Generator().manual_seed(1)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=generator)
        optimizer.step()
    return [p.detach() for p in params], optimizer


def test_with_fp32_moments_it_is_torchs_adamw_step_for_step(monkeypatch):
    monkeypatch.setattr(moment_adamw, "_CHUNK", 16)  # a parameter of 150 elements in ten chunks
    kwargs = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8)
    ours, _ = _run(lambda groups: MomentDtypeAdamW(groups, **kwargs))
    torchs, _ = _run(lambda groups: torch.optim.AdamW(groups, foreach=False, **kwargs))
    assert all(torch.equal(a, b) for a, b in zip(ours, torchs))


def test_bf16_moments_take_half_the_bytes_and_adamws_steps_to_their_rounding():
    kwargs = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8)
    narrow, optimizer = _run(lambda groups: MomentDtypeAdamW(groups, exp_avg_dtype=torch.bfloat16, exp_avg_sq_dtype=torch.bfloat16, **kwargs))
    wide, reference = _run(lambda groups: torch.optim.AdamW(groups, foreach=False, **kwargs))
    state = optimizer.state[next(iter(optimizer.state))]
    assert state["exp_avg"].dtype == state["exp_avg_sq"].dtype == torch.bfloat16
    start = _params()
    for a, b, p0 in zip(narrow, wide, start):
        moved = (b - p0).abs().max()
        assert (a - b).abs().max() <= 2e-2 * moved, "the update differs by more than the moments' bf16 rounding"
        assert not torch.equal(a, b), "bf16 moments round: equal results would mean they are not bf16"


def test_a_loaded_state_keeps_its_bf16_moments():
    _, optimizer = _run(lambda groups: MomentDtypeAdamW(groups, lr=1e-2, exp_avg_dtype=torch.bfloat16, exp_avg_sq_dtype=torch.bfloat16))
    saved = optimizer.state_dict()
    params = _params()
    again = MomentDtypeAdamW([{"params": params[:1], "weight_decay": 0.1}, {"params": params[1:], "weight_decay": 0.0}],
                             lr=1e-2, exp_avg_dtype=torch.bfloat16, exp_avg_sq_dtype=torch.bfloat16)
    again.load_state_dict(saved)  # torch casts the state to the parameters' fp32
    for index, p in enumerate(params):
        assert again.state[p]["exp_avg"].dtype == torch.bfloat16 and again.state[p]["exp_avg_sq"].dtype == torch.bfloat16
        assert torch.equal(again.state[p]["exp_avg"], saved["state"][index]["exp_avg"])


BF16_MOMENTS = ["--bf16", "--use-precision-aware-optimizer", "--exp-avg-dtype", "bf16", "--exp-avg-sq-dtype", "bf16"]
RESUMABLE = TINY + ["--hidden-dropout", "0.1", "--lr-decay-iters", "6", "--log-interval", "1"]


def _losses_and_moment_dtypes(flags: list[str]):
    from hybridlm.training import trainer
    dtypes = set()
    original = trainer.train_step

    def step_and_look(run, batches):
        loss = original(run, batches)
        base = run.engine.optimizer.optimizer if hasattr(run.engine.optimizer, "optimizer") else run.engine.optimizer
        dtypes.update(str(s[k].dtype) for s in base.state.values() for k in ("exp_avg", "exp_avg_sq") if k in s)
        return loss

    trainer.train_step = step_and_look
    try:
        return [r["loss"] for r in trainer.pretrain(flags)], sorted(dtypes)
    finally:
        trainer.train_step = original


@pytest.mark.parametrize("zero", ["zero1", "zero2"])
def test_under_zero_the_moments_stay_bf16_and_a_resumed_run_continues_bit_for_bit(tmp_path, zero):
    flags = RESUMABLE + BF16_MOMENTS + ds_config(zero)
    whole, dtypes = run_ranks(2, _losses_and_moment_dtypes, flags + ["--train-iters", "6"])[0]
    first, _ = run_ranks(2, _losses_and_moment_dtypes, flags + ["--train-iters", "3", "--save", str(tmp_path)])[0]
    second, resumed = run_ranks(2, _losses_and_moment_dtypes, flags + ["--train-iters", "6", "--load", str(tmp_path), "--save", str(tmp_path)])[0]
    assert dtypes == resumed == ["torch.bfloat16"]
    assert first + second == whole
    wide, _ = run_ranks(2, _losses_and_moment_dtypes, RESUMABLE + ["--bf16"] + ds_config(zero) + ["--train-iters", "6"])[0]
    assert max(abs(a - b) / b for a, b in zip(whole, wide)) < 2e-2, (whole, wide)


@pytest.mark.parametrize("flags, says", [
    (["--exp-avg-dtype", "bf16", "--bf16"], "--exp-avg-dtype bf16 needs --use-precision-aware-optimizer"),
    (["--use-precision-aware-optimizer", "--exp-avg-sq-dtype", "bf16"], "needs --bf16 or --fp16"),
    (BF16_MOMENTS + ds_config("zero3_offload_cpu"), "offloads the optimizer"),
    (BF16_MOMENTS + ["--optimizer-impl", "deepspeed_cpu"], "DeepSpeed's CPU Adam keeps fp32 moments"),
])
def test_what_cannot_work_is_one_sentence_before_any_process_group(flags, says):
    from hybridlm.config import ConfigError, parse_args
    from hybridlm.training.trainer import prepare_config
    with pytest.raises(ConfigError, match=says):
        prepare_config(parse_args(TINY + flags))


def test_the_memory_planner_counts_bf16_moments_at_half_the_bytes():
    from hybridlm.config import parse_args
    from hybridlm.planner.memory import layout_from_run, model_states
    from hybridlm.training.trainer import prepare_config
    plans = {}
    for name, extra in (("fp32 moments", []), ("bf16 moments", BF16_MOMENTS[1:])):
        cfg, ds = prepare_config(parse_args(TINY + ["--bf16"] + extra + ds_config("zero1")))
        plans[name] = model_states(1e9, layout_from_run(cfg, ds)).optimizer
    assert plans == {"fp32 moments": 12e9, "bf16 moments": 8e9}  # master 4 bytes + moments 8 or 4, one DP rank
