"""--exit-signal-handler: a signal to any one rank makes every rank save at the same step and
exit with the requeue code, and the resumed run continues as if never stopped."""
from __future__ import annotations

import json
import os
import signal

import pytest

from harness import run_ranks
from oracle import TINY, ds_config

FLAGS = TINY + ds_config("zero1") + ["--hidden-dropout", "0.1", "--train-iters", "5", "--lr-decay-iters", "5",
                                     "--log-interval", "1"]


def _losses(flags: list[str]) -> list[float]:
    from hybridlm.training.trainer import pretrain
    return [r["loss"] for r in pretrain(flags)]


def _main_signalling(flags: list[str], signal_rank: int, at_iteration: int) -> int:
    """Run main(); rank ``signal_rank`` sends itself SIGUSR1 right after step ``at_iteration``."""
    import torch.distributed as dist

    from hybridlm.training import trainer
    original = trainer.train_step

    def step_then_signal(run, batches):
        loss = original(run, batches)
        if run.iteration == at_iteration and dist.get_rank() == signal_rank:
            os.kill(os.getpid(), signal.SIGUSR1)
        return loss

    trainer.train_step = step_then_signal
    return trainer.main(flags)


def _iterations_and_losses(path) -> list[tuple[int, float]]:
    with open(path) as f:
        return [(r["iteration"], r["loss"]) for r in map(json.loads, f)]


def test_a_signal_to_one_rank_saves_on_all_and_the_requeued_run_resumes_bit_for_bit(tmp_path):
    from hybridlm.training.preemption import EXIT_CODE
    whole = run_ranks(2, _losses, FLAGS)[0]
    run_dir, metrics = tmp_path / "run", tmp_path / "metrics.jsonl"
    flags = FLAGS + ["--save", str(run_dir), "--load", str(run_dir), "--exit-signal-handler", "--exit-signal", "SIGUSR1",
                     "--metrics-file", str(metrics)]
    assert run_ranks(2, _main_signalling, flags, 1, 2) == [EXIT_CODE, EXIT_CODE]
    assert (run_dir / "latest").read_text() == "global_step2"
    assert {f"rng_state_rank{r}.pt" for r in (0, 1)} <= set(os.listdir(run_dir / "global_step2"))
    # The requeued job: the same command line, no signal this time.
    assert run_ranks(2, _main_signalling, flags, 1, -1) == [0, 0]
    logged = _iterations_and_losses(metrics)
    assert [i for i, _ in logged] == [1, 2, 3, 4, 5]
    assert [loss for _, loss in logged] == whole


def test_the_handler_notes_the_signal_and_restores_the_previous_disposition():
    from hybridlm.training.preemption import ExitSignal
    handler = ExitSignal("SIGUSR2")
    os.kill(os.getpid(), signal.SIGUSR2)
    assert handler.received and handler.agreed("cpu")
    handler.restore()
    assert signal.getsignal(signal.SIGUSR2) == signal.SIG_DFL


def test_exit_signal_handler_needs_save():
    from hybridlm.config import ConfigError, parse_args
    with pytest.raises(ConfigError, match="--exit-signal-handler needs --save"):
        parse_args(["--exit-signal-handler"]).validate(1)
