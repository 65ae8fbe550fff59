"""The learning-rate schedule: Megatron-LM's formula, step by step."""
from __future__ import annotations

import math

import pytest
import torch

from hybridlm.training.optim import WarmupDecayLR, param_groups


def megatron_get_lr(num_steps, *, init_lr, max_lr, min_lr, warmup, decay, style, wsd_decay=None, wsd_style=None):
    """A direct transcription of megatron/core/optimizer_param_scheduler.py OptimizerParamScheduler.get_lr."""
    if warmup > 0 and num_steps <= warmup:
        return init_lr + ((max_lr - init_lr) * float(num_steps) / float(warmup))
    if style == 'constant':
        return max_lr
    if num_steps > decay:
        return min_lr
    if style == 'inverse-square-root':
        warmup_steps = max(warmup, 1)
        n = max(num_steps, 1)
        lr = max_lr * warmup_steps**0.5 / (n**0.5)
        return max(min_lr, lr)
    num_steps_ = num_steps - warmup
    decay_steps_ = decay - warmup
    decay_ratio = float(num_steps_) / float(decay_steps_)
    assert 0.0 <= decay_ratio <= 1.0
    delta_lr = max_lr - min_lr
    if style == 'linear':
        coeff = 1.0 - decay_ratio
    elif style == 'cosine':
        coeff = 0.5 * (math.cos(math.pi * decay_ratio) + 1.0)
    elif style == 'WSD':
        wsd_anneal_start_ = decay - wsd_decay
        if num_steps <= wsd_anneal_start_:
            coeff = 1.0
        else:
            wsd_steps = num_steps - wsd_anneal_start_
            wsd_decay_ratio = float(wsd_steps) / float(wsd_decay)
            if wsd_style == "linear":
                coeff = 1.0 - wsd_decay_ratio
            elif wsd_style == "cosine":
                coeff = 0.5 * (math.cos(math.pi * wsd_decay_ratio) + 1.0)
            elif wsd_style == "exponential":
                coeff = (2.0 * math.pow(0.5, wsd_decay_ratio)) - 1.0
            elif wsd_style == "minus_sqrt":
                coeff = 1.0 - math.sqrt(wsd_decay_ratio)
    return min_lr + coeff * delta_lr


def _lrs(steps: int, **kwargs) -> list[float]:
    """The rate each of ``steps`` optimizer steps trains with, as DeepSpeed drives the schedule."""
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.0)
    schedule = WarmupDecayLR(optimizer, **kwargs)
    lrs = []
    for _ in range(steps):
        lrs.append(optimizer.param_groups[0]["lr"])
        schedule.step()
    return lrs


def _megatron_lrs(steps: int, batch: int, **kwargs) -> list[float]:
    """Megatron's scheduler: step(0) at construction, then step(increment=global batch) after each iteration."""
    return [megatron_get_lr(i * batch, **kwargs) for i in range(steps)]


CASES = [  # name, steps, samples per step, schedule in samples
    ("warmup then cosine", 12, 4, dict(init_lr=0.0, max_lr=1.0, min_lr=0.1, warmup=8, decay=40, style="cosine")),
    ("warmup from an initial rate", 6, 2, dict(init_lr=0.2, max_lr=1.0, min_lr=0.0, warmup=6, decay=10, style="linear")),
    ("linear, no warm-up", 6, 1, dict(init_lr=0.0, max_lr=1.0, min_lr=0.0, warmup=0, decay=4, style="linear")),
    ("constant", 4, 3, dict(init_lr=0.0, max_lr=2.0, min_lr=0.0, warmup=3, decay=12, style="constant")),
    ("inverse square root", 8, 2, dict(init_lr=0.0, max_lr=1.0, min_lr=0.05, warmup=4, decay=100, style="inverse-square-root")),
    ("warm-up fraction of the decay", 10, 8, dict(init_lr=0.0, max_lr=1.0, min_lr=0.0, warmup=0.001 * 72, decay=72, style="cosine")),
    ("samples not multiples of the batch", 10, 8, dict(init_lr=0.0, max_lr=1.5e-4, min_lr=1e-5, warmup=13, decay=70, style="cosine")),
] + [(f"WSD {shape}", 12, 2, dict(init_lr=0.0, max_lr=1.0, min_lr=0.01, warmup=4, decay=20, style="WSD", wsd_decay=8, wsd_style=shape))
     for shape in ("linear", "cosine", "exponential", "minus_sqrt")]


@pytest.mark.parametrize("name, steps, batch, schedule", CASES, ids=[c[0] for c in CASES])
def test_schedule_equals_megatrons_formula_step_by_step(name, steps, batch, schedule):
    ours = _lrs(steps, lr=schedule["max_lr"], min_lr=schedule["min_lr"], init_lr=schedule["init_lr"],
                warmup_steps=schedule["warmup"], decay_steps=schedule["decay"], style=schedule["style"],
                wsd_decay_steps=schedule.get("wsd_decay"), wsd_style=schedule.get("wsd_style") or "exponential", increment=batch)
    assert ours == pytest.approx(_megatron_lrs(steps, batch, **schedule), rel=1e-12, abs=0)


def test_first_warmup_step_trains_at_the_initial_rate():
    assert _lrs(3, lr=1.0, min_lr=0.0, warmup_steps=2, decay_steps=10, style="linear") == pytest.approx([0.0, 0.5, 1.0])


def test_schedule_state_round_trips():
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.0)
    schedule = WarmupDecayLR(optimizer, lr=1.0, min_lr=0.0, warmup_steps=0, decay_steps=8, style="linear", increment=2)
    schedule.step()
    restored = WarmupDecayLR(optimizer, lr=1.0, min_lr=0.0, warmup_steps=0, decay_steps=8, style="linear", increment=2)
    restored.load_state_dict(schedule.state_dict())
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.75)


def test_no_weight_decay_on_norms_and_biases():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    decay, no_decay = param_groups(model, 0.1)
    assert [p.shape for p in decay["params"]] == [torch.Size([4, 4])]
    assert len(no_decay["params"]) == 3 and no_decay["weight_decay"] == 0.0
