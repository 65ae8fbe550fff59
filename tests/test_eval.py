"""Evaluation: the logged validation loss is the model's mean loss on the validation samples."""
from __future__ import annotations

import math

import pytest
import torch

from harness import run_ranks
from oracle import TINY, ds_config

FROZEN = TINY + ["--lr", "0", "--min-lr", "0", "--train-iters", "2", "--eval-interval", "2", "--eval-iters", "2",
                 "--log-interval", "1"]


def _valid_records(flags):
    from hybridlm.training.trainer import pretrain
    return [r for r in pretrain(flags) if "valid_loss" in r]


def _hand_computed_valid_loss(flags):
    """Forward the freshly initialised single-process model over the same validation batches."""
    from hybridlm.config import parse_args
    from hybridlm.training.trainer import build_run, data_iterator, prepare_config
    cfg, ds = prepare_config(parse_args(flags))
    run = build_run(cfg, ds)
    model = run.engine.module.eval()
    batches = data_iterator(run, run.valid_data, start_iteration=0)
    steps = cfg.train.eval_iters * cfg.gradient_accumulation_steps
    with torch.no_grad():
        return sum(model(*next(batches)).item() for _ in range(steps)) / steps


@pytest.mark.parametrize("world, layout, zero", [pytest.param(2, ["--tensor-model-parallel-size", "2"], "zero1", id="tp2"),
                                                 pytest.param(2, ["--pipeline-model-parallel-size", "2"], "zero1", id="pp2"),
                                                 pytest.param(4, ["--pipeline-model-parallel-size", "2"], "zero1", id="pp2_dp2"),
                                                 pytest.param(2, [], "zero3", id="dp2_zero3")])
def test_validation_loss_and_perplexity_match_a_hand_computed_forward(world, layout, zero):
    want = run_ranks(1, _hand_computed_valid_loss, FROZEN + ds_config("zero0"))[0]
    [record] = run_ranks(world, _valid_records, FROZEN + layout + ds_config(zero))[0]
    assert record["iteration"] == 2
    assert record["valid_loss"] == pytest.approx(want, rel=1e-5)
    assert record["valid_ppl"] == pytest.approx(math.exp(want), rel=1e-5)
