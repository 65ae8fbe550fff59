"""`mpirun -np N python scripts/pretrain.py ...` on CPU with Open MPI: ranks, world size and the
rendezvous come from MPI (mpi4py and DeepSpeed's MPI discovery), and the job computes what one
process computes."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from harness import run_command, run_ranks
from oracle import ROOT, TINY, ds_config

pytestmark = pytest.mark.skipif(shutil.which("mpirun") is None, reason="no mpirun (apt-get install openmpi-bin libopenmpi-dev)")

FLAGS = TINY + ["--train-iters", "3", "--log-interval", "1"]


def _mpirun(ranks: int, args: list[str], timeout: float = 240) -> subprocess.CompletedProcess:
    # As root Open MPI wants these two variables; --oversubscribe lets 4 ranks share 2 cores.
    env = {**os.environ, "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1", "DS_ACCELERATOR": "cpu",
           "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)  # only MPI may say who is who
    return run_command(["mpirun", "-np", str(ranks), "--oversubscribe", sys.executable, *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


def _losses(path) -> list[float]:
    with open(path) as f:
        return [json.loads(line)["loss"] for line in f]


def _single_process_losses(flags: list[str]) -> list[float]:
    from hybridlm.training.trainer import pretrain
    return [r["loss"] for r in pretrain(flags)]


def test_mpi4py_runs_on_the_mpi_of_mpirun():
    # Rank 0 reports what it gathered: one line, so the two ranks' output cannot interleave.
    code = ("from mpi4py import MPI; c = MPI.COMM_WORLD; ranks = c.gather(c.Get_rank()); "
            "c.Get_rank() == 0 and print('ranks', sorted(ranks), 'size', c.Get_size(), flush=True)")
    result = _mpirun(2, ["-c", code], timeout=60)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "ranks [0, 1] size 2" in result.stdout  # size 1 twice would mean a different MPI


@pytest.fixture(scope="module")
def single_process_losses() -> list[float]:
    return run_ranks(1, _single_process_losses, FLAGS + ds_config("zero1"))[0]


@pytest.mark.slow
def test_mpirun_np4_trains_tp2_x_dp2_and_matches_the_single_process_losses(tmp_path, single_process_losses):
    # One launch: four ranks that learn who they are from MPI, split into TP and DP groups (a DP-only run is the
    # same discovery and the same gradient reduction, with fewer groups).
    want = single_process_losses
    result = _mpirun(4, ["scripts/pretrain.py", *FLAGS, "--tensor-model-parallel-size", "2", *ds_config("zero1"),
                         "--metrics-file", str(tmp_path / "m.jsonl")])
    assert result.returncode == 0, result.stderr[-3000:]
    assert "TP=2 PP=1 DP=2" in result.stdout
    got = _losses(tmp_path / "m.jsonl")
    assert len(got) == 3
    for step, (a, b) in enumerate(zip(want, got), start=1):
        assert abs(a - b) <= 1e-5 * abs(a), f"step {step}: mpirun -np 4 loss {b} != single-process {a}"
