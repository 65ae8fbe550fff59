"""AdamW's first step is step 1 at every ZeRO stage: in bf16 at ZeRO-0, DeepSpeed's FP16_UnfusedOptimizer steps the
client optimizer once with zero gradients as it wraps it, which left every later bias correction a step late (the
first update 0.73 x the learning rate) and decayed the master weights once at the peak rate. hybridlm builds the
optimizer at rate 0 and drops that step's state (hybridlm.training.optim.drop_startup_step)."""
from __future__ import annotations

import pytest

from harness import run_ranks
from oracle import TINY, ds_config

LR = 1e-2  # TINY's --lr, no warm-up: the first step is taken at it
QKV = "1.attention.qkv.weight"


def _first_update_and_losses(flags: list[str]):

    from hybridlm.config import parse_args
    from hybridlm.training.trainer import build_run, data_iterator, prepare_config, train_step
    cfg, ds = prepare_config(parse_args(flags))
    run = build_run(cfg, ds)
    before = {n: p.detach().float().clone() for n, p in run.engine.module.named_parameters()}
    batches = data_iterator(run)
    losses = [train_step(run, batches).item()]
    qkv = dict(run.engine.module.named_parameters())[QKV]  # every entry has a gradient; weights ~0.02, fine in bf16
    moved = float((qkv.detach().float() - before[QKV]).abs().median())
    losses += [train_step(run, batches).item() for _ in range(3)]
    return moved, losses, type(run.engine.optimizer).__name__


@pytest.mark.parametrize("zero", ["zero0", "zero1"])
def test_in_bf16_adamws_first_update_is_the_learning_rate_at_every_zero_stage(zero):
    moved, losses, wrapper = run_ranks(1, _first_update_and_losses, TINY + ["--bf16"] + ds_config(zero))[0]
    # Adam's first step moves each weight by lr x g / |g| = lr (less the decay's 1e-6)
    assert abs(moved - LR) <= 0.02 * LR, f"{wrapper}: median first update {moved:.4g}, learning rate {LR}"


def test_bf16_trains_the_same_at_zero_0_as_at_zero_1():
    zero0 = run_ranks(1, _first_update_and_losses, TINY + ["--bf16"] + ds_config("zero0"))[0]
    zero1 = run_ranks(1, _first_update_and_losses, TINY + ["--bf16"] + ds_config("zero1"))[0]
    assert zero0[2] == "FP16_UnfusedOptimizer", "the test should cover DeepSpeed's ZeRO-0 half-precision wrapper"
    assert max(abs(a - b) / b for a, b in zip(zero0[1], zero1[1])) < 1e-3, (zero0[1], zero1[1])
