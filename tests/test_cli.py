"""What a user types: the `deepspeed` launcher running scripts/pretrain.py on CPU.

Each launch costs a launcher and its ranks' start-up, so a launch here checks what only a launch can (the launcher's
environment, the flags as typed, the metrics file); which layouts compute the single-process function is the
oracle's to say, on forked ranks (test_oracle.py, test_context_parallel.py)."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

from harness import launch_deepspeed as _launch
from harness import run_ranks
from oracle import ROOT, TINY

pytestmark = pytest.mark.slow


def _losses(path) -> list[float]:
    with open(path) as f:
        return [json.loads(line)["loss"] for line in f]


COMMON = ["scripts/pretrain.py", "--deepspeed_config", "ds_configs/zero1.json", *TINY, "--train-iters", "3", "--log-interval", "1"]


def _pretrain_main(argv: list[str]) -> int:
    from hybridlm.training.trainer import main
    return main(argv)


@pytest.fixture(scope="module")
def single_process_losses(tmp_path_factory) -> list[float]:
    """scripts/pretrain.py's main as one process (a forked rank: the launcher adds nothing to one process's math)."""
    path = tmp_path_factory.mktemp("cli") / "one.jsonl"
    assert run_ranks(1, _pretrain_main, [*COMMON[1:], "--metrics-file", str(path)]) == [0]
    return _losses(path)


def _assert_same_losses(want: list[float], path, layout: str) -> None:
    got = _losses(path)
    assert len(want) == len(got) == 3
    for step, (a, b) in enumerate(zip(want, got), start=1):
        assert abs(a - b) <= 1e-5 * abs(a), f"step {step}: {layout} loss {b} != single-process {a}"


def test_deepspeed_launcher_cp2_gives_the_single_process_losses_and_logs_every_metric(tmp_path, single_process_losses):
    # One 2-rank launch for what only a launch can show: the launcher's environment, the flags as typed, the metrics
    # file. CP here: each rank holds half of every sample, the case where counting a step's tokens and FLOPs per GPU
    # can go wrong (two ranks show it as four would). PP under a launcher: test_megatron_scripts.py (torchrun); four
    # launched ranks (TP2 x DP2): test_mpi.py (mpirun). The layouts themselves (TP2 x CP2 x SP, TP2 x PP2, CP4 a2a
    # under ZeRO-3, PP2 x CP2 allgather, ...): test_oracle.py, test_context_parallel.py, forked.
    layout = ["--context-parallel-size", "2"]
    split = _launch(["--num_gpus", "2", *COMMON, *layout, "--metrics-file", str(tmp_path / "cp.jsonl")])
    assert split.returncode == 0, split.stderr[-3000:]
    assert "CP=2" in split.stdout and "DP=1" in split.stdout
    _assert_same_losses(single_process_losses, tmp_path / "cp.jsonl", " ".join(layout))
    record = json.loads(open(tmp_path / "cp.jsonl").readline())
    assert {"iteration", "loss", "lr", "grad_norm", "tokens_per_sec", "tflops_per_gpu", "mfu"} <= set(record)
    _assert_flops_count_every_token_once(tmp_path / "cp.jsonl", world=2)


def _assert_flops_count_every_token_once(path, world: int) -> None:
    """TFLOP/s per GPU = Megatron's FLOPs per token x the global batch's tokens / world / step time,
    whatever slice of each sample a rank holds (8 samples of 32 tokens in TINY)."""
    from hybridlm.config import parse_args
    from hybridlm.training.metrics import flops_per_token
    per_token = flops_per_token(parse_args(TINY).validate(world_size=1).model)
    for line in open(path):
        record = json.loads(line)
        assert record["tokens_per_sec_per_gpu"] * world * record["step_seconds"] == pytest.approx(8 * 32)
        assert record["tflops_per_gpu"] * 1e12 == pytest.approx(per_token * record["tokens_per_sec_per_gpu"])


def test_deepspeed_launcher_bad_layout_exits_fast_with_one_sentence_and_no_traceback():
    # Fast means before any process group or model exists (the sentence comes from validation, and no rank logs
    # its layout); a rank that hung instead would meet the launch's timeout.
    result = _launch(["--num_gpus", "2", "scripts/pretrain.py", "--deepspeed_config", "ds_configs/zero2.json",
                      "--pipeline-model-parallel-size", "2"], timeout=120)
    assert result.returncode != 0
    sentence = "cannot be combined with --pipeline-model-parallel-size 2"
    # Each rank validates before any process group and prints the sentence once; the launcher kills the
    # other rank as soon as the first exits, so the second sentence may or may not make it out.
    assert 1 <= result.stderr.count(sentence) <= 2, result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    assert "hybridlm: ParallelState" not in result.stdout + result.stderr, "a rank built its process groups first"


def test_every_rank_of_a_refused_launch_refuses_before_importing_torch():
    # The launched script answers what the flags, the JSON and the world size decide before it imports torch, DeepSpeed
    # and torch's compiler (~7 s of CPU a rank): the bad layout above, as its rank 1 runs it.
    probe = ("import sys; from hybridlm.training.entry import main; code = main(sys.argv[1:]); "
             "print('exit', code, 'torch imported' if 'torch' in sys.modules else 'torch not imported')")
    result = subprocess.run([sys.executable, "-c", probe, "--deepspeed_config", "ds_configs/zero2.json",
                             "--pipeline-model-parallel-size", "2"], cwd=ROOT, capture_output=True, text=True, timeout=120,
                            env={**os.environ, "WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "1"})
    assert result.stdout.split() == ["exit", "2", "torch", "not", "imported"], result.stdout + result.stderr[-2000:]
    assert result.stderr.count("cannot be combined with --pipeline-model-parallel-size 2") == 1, result.stderr


def test_the_readme_command_trains_the_builtin_model_and_its_loss_falls_well_below_chance(tmp_path):
    # The README's command (plus a metrics file to read the losses back), cut from the default 300 steps to 60: the
    # launcher, the built-in model, corpus and schedule are the default run's (each step ~0.2 s of CPU). Chance on the
    # built-in byte vocabulary is ln(256) = 5.55 nats; the logged losses of 60 steps fall 3.6, 3.2, 3.1, 2.7, 3.0, 2.7.
    result = _launch(["scripts/pretrain.py", "--deepspeed_config", "ds_configs/zero1.json", "--train-iters", "60",
                      "--metrics-file", str(tmp_path / "m.jsonl")], timeout=420)
    assert result.returncode == 0, result.stderr[-3000:]
    losses = _losses(tmp_path / "m.jsonl")
    assert len(losses) == 6, "the built-in run logs every 10 steps"
    [setup] = [line for line in result.stdout.splitlines() if line.startswith("hybridlm: set-up ")]  # rank 0's, once
    assert " imports " in setup, setup  # the phases of the tiny model take under 0.05 s each and are left out
    assert losses[-1] < losses[0] - 0.5 and losses[-1] < 0.55 * math.log(256), \
        f"loss did not fall enough: {' '.join(f'{x:.3f}' for x in losses)}"
