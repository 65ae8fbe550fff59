"""--save / --load through DeepSpeed's engine: a resumed run continues the same losses."""
from __future__ import annotations

import pytest

from harness import run_ranks
from oracle import TINY, ds_config


def _losses(flags: list[str]) -> list[float]:
    from hybridlm.training.trainer import pretrain
    return [r["loss"] for r in pretrain(flags + ["--log-interval", "1"])]


@pytest.mark.parametrize("world, layout, zero", [pytest.param(2, [], "zero1", id="dp2_zero1"),
                                                 pytest.param(2, ["--pipeline-model-parallel-size", "2"], "zero1", id="pp2"),
                                                 pytest.param(2, ["--tensor-model-parallel-size", "2"], "zero3", id="tp2_zero3")])
def test_resumed_run_continues_the_uninterrupted_losses(tmp_path, world, layout, zero):
    flags = TINY + layout + ds_config(zero) + ["--lr-decay-iters", "4"]  # one schedule for all three runs
    whole = run_ranks(world, _losses, flags + ["--train-iters", "4"])[0]
    first = run_ranks(world, _losses, flags + ["--train-iters", "2", "--save", str(tmp_path)])[0]
    assert (tmp_path / "latest").read_text().strip() == "global_step2"
    second = run_ranks(world, _losses, flags + ["--train-iters", "4", "--load", str(tmp_path)])[0]
    assert first == whole[:2]
    assert len(second) == 2
    for want, got in zip(whole[2:], second):
        assert abs(got - want) <= 1e-6 * abs(want), f"resumed loss {got} != uninterrupted {want}"
