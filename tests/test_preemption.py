"""--exit-signal-handler: a signal to any one rank makes every rank save at the same step and
exit with the requeue code, and the resumed run continues as if never stopped. Without it, SIGINT
(Ctrl-C) and SIGTERM do the same with exit code 128 + the signal's number."""
from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import sys

import pytest

from harness import port_was_taken, run_ranks
from oracle import ROOT, TINY, ds_config

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
    # whatever this process inherited (SIG_DFL, or SIG_IGN under a parent that ignores it: `perf record` does), not a
    # fixed value: the handler puts back what was there
    before = signal.getsignal(signal.SIGUSR2)
    handler = ExitSignal("SIGUSR2")
    os.kill(os.getpid(), signal.SIGUSR2)
    assert handler.received and handler.agreed("cpu")
    handler.restore()
    assert signal.getsignal(signal.SIGUSR2) == before


def test_exit_signal_handler_needs_save():
    from hybridlm.config import ConfigError, parse_args
    with pytest.raises(ConfigError, match="--exit-signal-handler needs --save"):
        parse_args(["--exit-signal-handler"]).validate(1)


# ---------------------------------------------------------------- SIGINT and SIGTERM (issue 47, item 3)

def _main_stopped_by(flags: list[str], signal_rank: int, at_iteration: int, signum: int):
    """main() (stdout captured) where rank ``signal_rank`` receives ``signum`` right after step ``at_iteration``."""
    import contextlib
    import io

    import torch.distributed as dist

    from hybridlm.training import trainer
    original = trainer.train_step

    def step_then_signal(run, batches):
        loss = original(run, batches)
        if run.iteration == at_iteration and dist.get_rank() == signal_rank:
            os.kill(os.getpid(), signum)
        return loss

    trainer.train_step = step_then_signal
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = trainer.main(flags)
    return code, out.getvalue()


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_sigint_or_sigterm_to_one_rank_saves_on_every_rank_and_exits_with_one_line(tmp_path, signum):
    """Ctrl-C (or a launcher's SIGTERM) reaching any one rank: every rank finishes the step, saves it and exits
    128 + the signal's number; the log says what was saved where, and how to continue."""
    run_dir = tmp_path / "run"
    flags = FLAGS + ["--save", str(run_dir)]
    results = run_ranks(2, _main_stopped_by, flags, 1, 2, signum)
    assert [code for code, _ in results] == [128 + signum] * 2
    assert (run_dir / "latest").read_text() == "global_step2"
    name = signal.Signals(signum).name
    out = results[0][1]
    assert f"hybridlm: {name} received: saved global_step2 to {run_dir} and stopped at iteration 2 of 5; continue with " \
           f"--load {run_dir}." in out.splitlines()
    assert f"hybridlm: saved global_step2 to {run_dir} (" in out


def _stop_signals_then(sends: int, grace: float, repeat_window: float, wait: float) -> None:
    """In a child: watch SIGINT, receive it ``sends`` times, the later ones 0.1 s apart, then wait ``wait`` seconds
    (never reaching a save) and exit 0."""
    import time

    from hybridlm.training.preemption import StopSignals
    StopSignals(["SIGINT"], grace=grace, repeat_window=repeat_window)
    for i in range(sends):
        if i:
            time.sleep(0.1)
        os.kill(os.getpid(), signal.SIGINT)
    time.sleep(wait)
    os._exit(0)


def _exit_code_of(*args) -> int:
    import multiprocessing
    child = multiprocessing.get_context("fork").Process(target=_stop_signals_then, args=args)
    child.start()
    child.join(timeout=30)
    return child.exitcode


@pytest.mark.parametrize("sends, grace", [(2, 60.0), (1, 0.1)], ids=["second_ctrl_c", "no_step_ends_within_the_grace"])
def test_a_second_ctrl_c_or_a_step_that_never_ends_stops_at_once_without_saving(sends, grace):
    assert _exit_code_of(sends, grace, 0.05, 60.0) == 128 + signal.SIGINT


def test_the_same_ctrl_c_passed_on_again_by_a_launcher_is_not_a_second_press():
    # torchrun's agent passes the Ctrl-C it got on to the ranks, which got it from the terminal too: the copy comes
    # within the repeat window, and the rank keeps going to its save (here: it waits, then exits 0).
    assert _exit_code_of(2, 60.0, 60.0, 0.5) == 0


def _launch_and_interrupt(argv: list[str], metrics, timeout: float = 240):
    """Start a launcher command in a session of its own, and once the first step is logged send SIGINT to its whole
    process group, as Ctrl-C in a terminal does (the launcher and every rank get it). Returns (exit code, output)."""
    import subprocess
    import time

    from harness import _kill_session
    env = {**os.environ, "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""),
           "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(argv, cwd=ROOT, env=env, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    try:
        deadline = time.monotonic() + timeout
        while not (metrics.exists() and metrics.read_text().strip()) and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        with contextlib.suppress(ProcessLookupError):  # the launch ended first (its port was taken): its output says so
            os.killpg(proc.pid, signal.SIGINT)
        output, _ = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
        return proc.returncode, output
    finally:
        _kill_session(proc.pid)


def _launcher(name: str) -> list[str]:
    """The command that starts two CPU ranks under a launcher (the deepspeed launcher on a fresh port each time)."""
    from harness import free_port
    if name == "deepspeed":
        return [os.path.join(os.path.dirname(sys.executable), "deepspeed"), "--master_port", str(free_port()), "--num_gpus", "2"]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]


@pytest.mark.slow
@pytest.mark.parametrize("launcher", ["deepspeed", "torchrun"])
def test_ctrl_c_under_a_launcher_saves_the_step_in_flight(tmp_path, launcher):
    """The issue's case: Ctrl-C reaches the launcher and both ranks, and the launcher then passes the signal on or
    terminates the ranks (the deepspeed launcher: SIGTERM, SIGKILL after 30 s; torchrun: the signal again, SIGKILL
    after 30 s): the ranks still save before they exit, and say so."""
    run_dir, metrics = tmp_path / "run", tmp_path / "metrics.jsonl"
    flags = TINY + ds_config("zero1") + ["--train-iters", "200", "--log-interval", "1", "--save", str(run_dir),
                                         "--metrics-file", str(metrics)]
    for _ in range(3):  # the deepspeed launcher's port can be taken between free_port() and its bind: a fresh one
        _, output = _launch_and_interrupt(_launcher(launcher) + ["scripts/pretrain.py", *flags], metrics)
        if not port_was_taken(output):
            break
        metrics.unlink(missing_ok=True)
    latest = (run_dir / "latest").read_text()
    logged = [json.loads(line)["iteration"] for line in metrics.read_text().splitlines()]
    assert latest == f"global_step{logged[-1]}", output
    # which the ranks handle first is the scheduler's: the terminal's SIGINT, or the deepspeed launcher's SIGTERM
    said = re.search(rf"hybridlm: (SIGINT|SIGTERM) received: saved {latest} to {re.escape(str(run_dir))} and stopped at "
                     rf"iteration {logged[-1]} of 200", output)
    assert said and (said.group(1) == "SIGINT" or launcher == "deepspeed"), output
