"""One shard of the GPU suite on this machine, in lanes where it has two GPUs or more (``make test-gpu``).

    python3 tests/gpu_suite.py [--shard K/N] [--record DIR] [--lanes L] [-- more pytest arguments]

Most GPU tests need one GPU, some two, and each spends most of its time starting processes, so the shard runs in
passes by the GPUs its tests need (tests/gpu_shards.py): the one-GPU tests on pytest-xdist workers that each see one
GPU (four at once on four GPUs), the two-GPU tests on workers that each see a lane of two, then the tests marked
``gpus(n)`` for more, on every GPU. The passes write one ``gpu-tests`` record of the shard, marked finished here once
every pass has run. The first pass says how many of the shard's tests each pass has (``HYBRIDLM_GPU_PLAN``), and a
pass with none is not started: a pytest start with its collection costs 15-25 s on the GPU machine. The exit code is
the first failing pass's (a pass with no test of its kind is not a failure).
"""
from __future__ import annotations

import argparse
import datetime
import os
import socket
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from gpu_shards import CALL_ENV, LANE_WIDTHS, LANES_ENV, PASSES, PLAN_ENV, finish_record, lanes_of, read_plan  # noqa: E402

NO_TESTS_COLLECTED = 5  # pytest's exit code when -m / the pass leave nothing to run
PYTEST_TESTS_FAILED = 1  # a pass that ran to its end with failures (2-4: interrupted, internal or usage error)


def visible_gpus() -> list[str]:
    """The GPUs this process may use, as CUDA_VISIBLE_DEVICES names them for a child."""
    import torch
    given = [d for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    return given or [str(i) for i in range(torch.cuda.device_count())]


def passes(shard: str | None, record: str | None, gpus: list[str], lanes: int | None, extra: list[str]) -> list[tuple[list[str], dict]]:
    """The pytest commands of a shard, one a pass, and the environment each runs in."""
    call = f"{datetime.datetime.now().strftime('%Y-%m-%dT%H%M%S')}-{socket.gethostname().split('.')[0]}"
    env = {**os.environ, CALL_ENV: call}
    base = [sys.executable, "-m", "pytest", "-m", "gpu", "--durations=25"] + ([f"--shard={shard}"] if shard else []) + (
        [f"--gpu-record={record}"] if record else []) + extra
    commands = []
    for width in LANE_WIDTHS:
        cut = lanes_of(gpus, width)[:lanes] if lanes else lanes_of(gpus, width)
        laned, laned_env = base + [f"--gpu-pass=lanes{width}"], dict(env)
        if len(cut) > 1:
            # test by test, not file by file: a shard's slow tests of one file (test_gpu.py's, ~60 s each) once all went
            # to one lane, which ran 511 s while the other sat idle (4 x H200, ec03df3)
            laned += ["-n", str(len(cut)), "--dist=load"]
            laned_env[LANES_ENV] = ";".join(",".join(lane) for lane in cut)
        commands.append((laned, laned_env))
    return commands + [(base + ["--gpu-pass=whole"], env)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shard", default=None, help="K/N: the K-th of N shards (default: the whole GPU suite)")
    parser.add_argument("--record", default=None, help="a folder for the shard's gpu-tests record (records.jsonl)")
    parser.add_argument("--lanes", type=int, default=None, help="at most this many lanes at once (default: all the GPUs hold; 1: one pytest a pass)")
    parser.add_argument("extra", nargs="*", help="more pytest arguments (after --)")
    args = parser.parse_args()
    commands = passes(args.shard, args.record, visible_gpus(), args.lanes, args.extra)
    failed = []
    with tempfile.TemporaryDirectory(prefix="gpu_plan_") as folder:
        plan = os.path.join(folder, "plan.json")
        for gpu_pass, (command, env) in zip(PASSES, commands):  # passes() gives them in PASSES' order
            counts = read_plan(plan)
            if counts is not None and counts.get(gpu_pass) == 0:
                print(f"+ the {gpu_pass} pass: none of the shard's tests, not started", flush=True)
                continue
            print("+ " + " ".join(command), flush=True)
            code = subprocess.call(command, env={**env, PLAN_ENV: plan}, cwd=os.path.dirname(HERE))
            if code not in (0, NO_TESTS_COLLECTED):
                failed.append(code)
    if args.record and all(code == PYTEST_TESTS_FAILED for code in failed):  # every pass ran to its end
        finish_record(args.record, commands[0][1][CALL_ENV])
    return failed[0] if failed else 0


if __name__ == "__main__":
    sys.exit(main())
