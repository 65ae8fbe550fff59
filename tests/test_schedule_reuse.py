"""A reused run file trains on the schedule of the run that reuses it (issue 47, item 1): ``config.yaml``
records what the user set, never what was derived from it (the decay length, the global batch), a
schedule that would train at LR 0 is refused, and a resumed run trains with its own schedule's rate at
the iteration it resumes from, whatever changed since the save."""
from __future__ import annotations

import math
import os
import shlex

import pytest
import yaml

from harness import run_ranks
from oracle import TINY, ds_config
from test_convert import _hf_model

ZERO1 = ds_config("zero1")


def _continue_argv(line: str, data_flags: list[str]) -> list[str]:
    """The pretrain.py flags of convert_from_hf.py's "continue with: deepspeed scripts/pretrain.py ..." line,
    with its placeholders filled: ``--data-path ...`` by ``data_flags``, ``[--finetune]`` left out."""
    words = shlex.split(line.split("continue with:", 1)[1])
    words = words[words.index("scripts/pretrain.py") + 1:]
    at = words.index("--data-path")
    return [w for w in words[:at] + data_flags + words[at + 2:] if w != "[--finetune]"]


def test_the_printed_continue_command_with_a_longer_run_decays_over_the_whole_run(tmp_path):
    """The import's config.yaml holds no derived schedule: the continue command with --train-iters 400 (more
    than the default 300 the import was validated with) decays over 400 steps and never trains at LR 0."""
    from hybridlm.config import parse_args
    from hybridlm.interop.import_ import import_from_hf
    from hybridlm.training.optim import WarmupDecayLR
    from hybridlm.training.trainer import prepare_config
    _hf_model("llama", tmp_path / "hf", vocab_size=257)
    ckpt, lines = str(tmp_path / "ckpt"), []
    import_from_hf(str(tmp_path / "hf"), ckpt, seq_length=32, progress=False, log=lines.append)
    saved = yaml.safe_load(open(os.path.join(ckpt, "config.yaml")))
    assert "lr-decay-iters" not in saved and "global-batch-size" not in saved, saved
    line = next(line for line in lines if "continue with:" in line)
    argv = _continue_argv(line, ["--mock-data"]) + ["--train-iters", "400"] + ZERO1
    cfg, _ = prepare_config(parse_args(argv), world_size=1)
    assert cfg.train.lr_decay_iters == 400
    import torch
    schedule = WarmupDecayLR.from_config(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.0), cfg.train)
    assert schedule.lr_at(399) > 0


def test_a_run_file_saved_by_a_run_keeps_its_settings_and_not_their_derived_values(tmp_path):
    """config.yaml written with --save: the flags typed, not the decay length and global batch validate derived."""
    from hybridlm.config import effective_yaml, parse_args
    cfg = parse_args(TINY + ["--train-iters", "30", "--global-batch-size", "8"]).validate(1)
    saved = yaml.safe_load(effective_yaml(cfg))
    assert saved["train-iters"] == 30 and saved["global-batch-size"] == 8
    assert "lr-decay-iters" not in saved  # derived from --train-iters: a longer reuse decays over its own run
    reused = parse_args(["--config", _write(tmp_path / "config.yaml", saved), "--train-iters", "60"]).validate(1)
    assert reused.train.lr_decay_iters == 60


def _write(path, settings: dict) -> str:
    path.write_text(yaml.safe_dump(settings))
    return str(path)


@pytest.mark.parametrize("argv, sentence", [
    pytest.param(["--train-iters", "400", "--lr-decay-iters", "300"],
                 "--lr-decay-iters 300 ends the decay at iteration 300 of --train-iters 400 with --min-lr 0: the last 100 "
                 "iterations would train at LR 0", id="iterations"),
    pytest.param(["--global-batch-size", "8", "--train-samples", "800", "--lr-decay-samples", "400"],
                 "--lr-decay-samples 400 ends the decay at sample 400 of --train-samples 800 with --min-lr 0: the last 50 "
                 "iterations would train at LR 0", id="samples"),
])
def test_a_schedule_that_would_train_at_lr_0_is_refused_in_one_sentence(argv, sentence):
    from hybridlm.config import ConfigError, parse_args
    with pytest.raises(ConfigError) as caught:
        parse_args(argv + ["--min-lr", "0"]).validate(1)
    assert sentence in str(caught.value) and "\n" not in str(caught.value)


def test_a_decay_that_ends_early_at_a_positive_min_lr_is_megatrons_and_allowed():
    from hybridlm.config import parse_args
    cfg = parse_args(["--train-iters", "400", "--lr-decay-iters", "300", "--min-lr", "1e-5"]).validate(1)
    assert cfg.train.lr_decay_iters == 300


# ---------------------------------------------------------------- the rate after a resume

RESUME = TINY + ZERO1 + ["--log-interval", "1", "--lr-decay-style", "linear", "--min-lr", "0"]


def _first_lr(flags: list[str]) -> float:
    from hybridlm.training.trainer import pretrain
    return pretrain(flags)[0]["lr"]


def _linear(lr: float, iteration: int, decay_iters: int) -> float:
    return lr * (1 - iteration / decay_iters)


def test_a_resumed_run_trains_with_its_own_schedules_rate_at_the_iteration_it_resumes_from(tmp_path):
    """Saved at iteration 2 of 4; resumed with --train-iters 8 at the same layout, with another global batch, and
    at another layout: each first step trains at the 8-step schedule's rate of iteration 2."""
    run_dir = str(tmp_path / "run")
    run_ranks(1, _first_lr, RESUME + ["--train-iters", "2", "--lr-decay-iters", "4", "--save", run_dir])
    longer = RESUME + ["--train-iters", "8", "--load", run_dir]
    want = _linear(1e-2, 2, 8)
    assert run_ranks(1, _first_lr, longer)[0] == pytest.approx(want, rel=1e-6)  # same layout
    assert run_ranks(1, _first_lr, longer + ["--global-batch-size", "4"])[0] == pytest.approx(want, rel=1e-6)
    assert run_ranks(2, _first_lr, longer)[0] == pytest.approx(want, rel=1e-6)  # DP=2: resharded
    assert not math.isclose(want, _linear(1e-2, 2, 4))


def test_a_resume_keeps_the_clock_of_the_applied_steps_only():
    """Skipped steps (non-finite gradients) never moved the clock; the resumed clock leaves them out too, so a resume
    with unchanged flags is the uninterrupted run's schedule exactly and says nothing."""
    import torch

    from hybridlm.training.optim import WarmupDecayLR
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.0)
    schedule = WarmupDecayLR(optimizer, lr=1.0, min_lr=0.0, warmup_steps=0, decay_steps=80, style="linear", increment=8)
    for _ in range(3):  # iterations 1, 2 and 4 applied, 3 skipped
        schedule.step()
    assert schedule.continue_at(4, skipped=1) is None and schedule.num_steps == 24
    line = schedule.continue_at(6, skipped=1)
    assert schedule.num_steps == 40 and optimizer.param_groups[0]["lr"] == pytest.approx(0.5)
    assert line.startswith("the LR schedule continues at iteration 6 of this run's schedule (lr 5.000e-01, sample 40)")


def test_a_samples_counted_run_file_is_reused_with_another_global_batch(tmp_path):
    """The iterations a --train-samples run derived are not written: its config.yaml reused with another
    --global-batch-size derives its own instead of being refused for contradicting --train-samples."""
    from hybridlm.config import effective_yaml, parse_args
    cfg = parse_args(["--global-batch-size", "8", "--train-samples", "800"]).validate(1)
    saved = yaml.safe_load(effective_yaml(cfg))
    assert "train-iters" not in saved and saved["train-samples"] == 800
    reused = parse_args(["--config", _write(tmp_path / "config.yaml", saved), "--global-batch-size", "16"]).validate(1)
    assert reused.train.train_iters == 50
