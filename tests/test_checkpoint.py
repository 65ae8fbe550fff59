"""Checkpoints: a resumed run continues bit for bit, a checkpoint is "latest" only once
complete, and no crash or full disk can leave a broken latest behind."""
from __future__ import annotations

import os
import random
import resource
import signal
import time

import pytest

from harness import run_ranks, start_ranks
from oracle import TINY, ds_config

# Dropout on, so the resumed run is exact only if every random stream was restored too.
RESUMABLE = TINY + ["--hidden-dropout", "0.1", "--attention-dropout", "0.1", "--lr-decay-iters", "6", "--log-interval", "1"]


def _losses(flags: list[str]) -> list[float]:
    from hybridlm.training.trainer import pretrain
    return [r["loss"] for r in pretrain(flags)]


@pytest.mark.parametrize("world, layout, zero", [
    pytest.param(1, [], "zero0", id="zero0"),
    pytest.param(2, [], "zero1", id="dp2_zero1"),
    pytest.param(2, [], "zero2", id="dp2_zero2"),
    pytest.param(2, ["--tensor-model-parallel-size", "2"], "zero3", id="tp2_zero3"),
    pytest.param(2, ["--pipeline-model-parallel-size", "2"], "zero1", id="pp2"),
])
def test_resumed_run_reproduces_the_uninterrupted_losses_bit_for_bit(tmp_path, world, layout, zero):
    flags = RESUMABLE + layout + ds_config(zero)
    whole = run_ranks(world, _losses, flags + ["--train-iters", "6"])[0]
    first = run_ranks(world, _losses, flags + ["--train-iters", "3", "--save", str(tmp_path)])[0]
    second = run_ranks(world, _losses, flags + ["--train-iters", "6", "--load", str(tmp_path), "--save", str(tmp_path)])[0]
    assert first + second == whole


def test_keep_last_n_and_ckpt_step(tmp_path):
    flags = RESUMABLE + ds_config("zero1") + ["--save", str(tmp_path), "--save-interval", "1", "--keep-last-n-checkpoints", "2"]
    whole = run_ranks(2, _losses, flags + ["--train-iters", "5"])[0]
    assert sorted(n for n in os.listdir(tmp_path) if n.startswith("global_step")) == ["global_step4", "global_step5"]
    assert (tmp_path / "latest").read_text() == "global_step5"
    assert (tmp_path / "config.yaml").is_file() and (tmp_path / "ds_config.json").is_file()
    # --ckpt-step picks an older complete checkpoint over the latest.
    again = run_ranks(2, _losses, RESUMABLE + ds_config("zero1") + ["--train-iters", "5", "--load", str(tmp_path),
                                                                     "--ckpt-step", "4"])[0]
    assert again == whole[4:]


def _main(argv):
    from hybridlm.training.trainer import main
    return main(argv)


def test_an_existing_run_directory_is_refused_unless_resumed(tmp_path, capsys):
    flags = TINY + ds_config("zero0") + ["--train-iters", "1", "--save", str(tmp_path)]
    assert run_ranks(1, _main, flags)[0] == 0
    assert run_ranks(1, _main, flags)[0] == 2  # the same --save without --load: refused, nothing overwritten
    assert (tmp_path / "latest").read_text() == "global_step1"
    assert run_ranks(1, _main, flags[:-4] + ["--train-iters", "2", "--save", str(tmp_path), "--load", str(tmp_path)])[0] == 0
    assert (tmp_path / "latest").read_text() == "global_step2"


def _train_with_file_size_limit(flags: list[str], limit: int) -> str:
    """Let the first checkpoint save, then cap file sizes so the second save fails like a full disk."""
    from hybridlm.training import trainer
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit then fails with EFBIG instead of killing us
    original = trainer.save_checkpoint
    calls = []

    def save_then_fill_disk(run):
        original(run)
        calls.append(run.iteration)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    trainer.save_checkpoint = save_then_fill_disk
    try:
        trainer.pretrain(flags)
    except (OSError, RuntimeError) as e:  # torch.save reports EFBIG as an iostream RuntimeError
        return f"{type(e).__name__}: {e}"
    return "no error"


def test_a_failed_save_leaves_the_previous_latest_checkpoint_intact(tmp_path):
    flags = TINY + ds_config("zero1") + ["--train-iters", "4", "--save-interval", "2", "--save", str(tmp_path)]
    outcome = run_ranks(1, _train_with_file_size_limit, flags, 4096)[0]
    assert outcome != "no error"
    assert (tmp_path / "latest").read_text() == "global_step2"
    resumed = run_ranks(1, _losses, RESUMABLE + ds_config("zero1") + ["--train-iters", "4", "--load", str(tmp_path)])[0]
    assert len(resumed) == 2


def _kill_after(flags: list[str], delay: float) -> bool:
    """Start a single-rank training job and SIGKILL it after ``delay`` seconds, wherever it is; whether it was killed
    (rather than finished first)."""
    [child] = start_ranks(1, _losses, flags)
    child.join(timeout=delay)
    killed = child.is_alive()
    if killed:
        os.kill(child.pid, signal.SIGKILL)
    child.join()
    return killed


@pytest.mark.slow
def test_sigkill_at_random_points_always_resumes_from_the_last_complete_checkpoint(tmp_path):
    steps, interval = 12, 1  # a save every step: many kills land inside a save
    base = RESUMABLE + ds_config("zero1") + ["--train-iters", str(steps), "--lr-decay-iters", str(steps),
                                             "--save-interval", str(interval)]
    started = time.monotonic()
    whole = run_ranks(1, _losses, base)[0]
    # The kills land anywhere in a run as long as this one (start-up included), so on any machine they fall inside
    # the runs (which also save every step) rather than after them; where each lands is all the randomness does.
    span = time.monotonic() - started
    rng = random.Random(1234)
    killed = 0
    for trial in range(10):
        directory = tmp_path / f"trial{trial}"
        flags = base + ["--save", str(directory), "--load", str(directory), "--metrics-file", str(directory / "m.jsonl")]
        killed += _kill_after(flags, rng.uniform(0.0, span))
        logged = len(open(directory / "m.jsonl").readlines()) if (directory / "m.jsonl").exists() else 0
        latest = (directory / "latest").read_text() if (directory / "latest").exists() else None
        resumed_from = int(latest.removeprefix("global_step")) if latest else 0
        assert resumed_from >= logged - interval, f"trial {trial}: lost more than one save interval"
        rest = run_ranks(1, _losses, flags, timeout=120)[0]  # a resume that waits on a dead run's lock fails here
        assert rest == whole[resumed_from:], f"trial {trial}: resume from step {resumed_from} diverged"
    assert killed, "every run finished before its kill: nothing was tested"
