"""Learning-rate schedules against hand-computed values."""
from __future__ import annotations

import math

import pytest
import torch

from hybridlm.training.optim import WarmupDecayLR, param_groups


def _lrs(steps: int, **kwargs) -> list[float]:
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.0)
    schedule = WarmupDecayLR(optimizer, **kwargs)
    lrs = []
    for _ in range(steps):
        lrs.append(optimizer.param_groups[0]["lr"])
        schedule.step()
    return lrs


def test_warmup_then_cosine_to_min_lr():
    lrs = _lrs(8, lr=1.0, min_lr=0.1, warmup=2, decay_iters=6, style="cosine")
    want = [0.5, 1.0] + [0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * p / 4)) for p in (0, 1, 2, 3, 4)] + [0.1]
    assert lrs == pytest.approx(want)


def test_linear_and_constant():
    assert _lrs(5, lr=1.0, min_lr=0.0, warmup=0, decay_iters=4, style="linear") == pytest.approx([1.0, 0.75, 0.5, 0.25, 0.0])
    assert _lrs(4, lr=2.0, min_lr=0.0, warmup=1, decay_iters=4, style="constant") == pytest.approx([2.0, 2.0, 2.0, 2.0])


def test_wsd_holds_the_peak_then_decays_over_the_last_steps():
    lrs = _lrs(10, lr=1.0, min_lr=0.0, warmup=2, decay_iters=10, style="wsd", wsd_decay_iters=4, wsd_style="linear")
    assert lrs == pytest.approx([0.5, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.75, 0.5, 0.25])
    sqrt = _lrs(10, lr=1.0, min_lr=0.0, warmup=0, decay_iters=8, style="wsd", wsd_decay_iters=4, wsd_style="minus_sqrt")
    assert sqrt[4:9] == pytest.approx([1.0, 1 - math.sqrt(0.25), 1 - math.sqrt(0.5), 1 - math.sqrt(0.75), 0.0])
    expo = _lrs(6, lr=1.0, min_lr=0.01, warmup=0, decay_iters=4, style="wsd", wsd_decay_iters=2, wsd_style="exponential")
    assert expo[2:5] == pytest.approx([1.0, 0.1, 0.01])


def test_schedule_state_round_trips():
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.0)
    schedule = WarmupDecayLR(optimizer, lr=1.0, min_lr=0.0, warmup=0, decay_iters=4, style="linear")
    schedule.step()
    restored = WarmupDecayLR(optimizer, lr=1.0, min_lr=0.0, warmup=0, decay_iters=4, style="linear")
    restored.load_state_dict(schedule.state_dict())
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.75)


def test_no_weight_decay_on_norms_and_biases():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    decay, no_decay = param_groups(model, 0.1)
    assert [p.shape for p in decay["params"]] == [torch.Size([4, 4])]
    assert len(no_decay["params"]) == 3 and no_decay["weight_decay"] == 0.0
