"""Run a function on N real gloo ranks, forked from the test process.

Importing torch and DeepSpeed costs ~4.5 s per process; forking a parent that has already
imported them makes a multi-rank test cost little more than its own work. Each child
joins a fresh process group on a free loopback port, so tests never share state; the
parent never initialises torch.distributed itself (a forked child must not inherit a
live process group).

A rank that raises fails the test with that rank's traceback; a run that outlives
``timeout`` is killed and fails, so a broken collective can never hang the suite.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue as queue_module
import socket
import subprocess
import sys
import time
import traceback
from typing import Any, Callable


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child(rank: int, world: int, port: int, fn: Callable, args: tuple, results) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import torch
    torch.set_num_threads(1)
    try:
        payload = ("ok", fn(*args))
    except BaseException:  # noqa: BLE001 - everything goes back to the parent
        payload = ("error", traceback.format_exc())
    try:
        results.put((rank, pickle.dumps(payload)))
    except Exception:  # noqa: BLE001
        results.put((rank, pickle.dumps(("error", traceback.format_exc()))))
    results.close()
    results.join_thread()
    os._exit(0)


def _start(world: int, fn: Callable, args: tuple, start_method: str = "fork"):
    ctx = mp.get_context(start_method)
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_child, args=(r, world, port, fn, args, results), daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    return procs, results


def run_ranks(world: int, fn: Callable, *args, timeout: float = 180.0, start_method: str = "fork") -> list[Any]:
    """Call ``fn(*args)`` on ``world`` forked ranks; return their results ordered by rank.

    ``start_method="spawn"``: fresh interpreters instead (``fn`` importable by name), for ranks that use
    CUDA. A forked child cannot: the test process has already asked ``torch.cuda.is_available()``
    (conftest.py), which initialises the CUDA driver and so "poisons fork" (torch's own note on it)."""
    procs, results = _start(world, fn, args, start_method)
    outcomes: dict[int, tuple] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(outcomes) < world:
            try:
                rank, blob = results.get(timeout=max(0.1, min(1.0, deadline - time.monotonic())))
                outcomes[rank] = pickle.loads(blob)
                if outcomes[rank][0] == "error":
                    break  # the others are probably stuck in a collective with the dead rank
            except queue_module.Empty:
                pass
            if time.monotonic() > deadline:
                break
            dead = [r for r, p in enumerate(procs) if not p.is_alive() and r not in outcomes and p.exitcode not in (0, None)]
            if dead:
                outcomes[dead[0]] = ("error", f"rank {dead[0]} died with exit code {procs[dead[0]].exitcode}")
                break
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        for p in procs:
            p.join(timeout=10)
    errors = [f"--- rank {r} ---\n{o[1]}" for r, o in sorted(outcomes.items()) if o[0] == "error"]
    if errors:
        raise AssertionError("a rank failed:\n" + "\n".join(errors))
    if len(outcomes) < world:
        missing = sorted(set(range(world)) - set(outcomes))
        raise AssertionError(f"ranks {missing} did not finish within {timeout:.0f} s")
    return [outcomes[r][1] for r in range(world)]


def start_ranks(world: int, fn: Callable, *args) -> list:
    """Start ``fn(*args)`` on ``world`` forked ranks without waiting: for tests that kill them."""
    return _start(world, fn, args)[0]


def launch_deepspeed(args: list[str], timeout: float = 240) -> subprocess.CompletedProcess:
    """What a user types: the ``deepspeed`` launcher (CPU, gloo) with ``args``, from the repository root."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    bin_dir = os.path.dirname(sys.executable)
    env = {**os.environ, "PATH": bin_dir + os.pathsep + os.environ.get("PATH", ""), "OMP_NUM_THREADS": "1",
           "DS_ACCELERATOR": "cpu", "PYTHONUNBUFFERED": "1"}
    # A free rendezvous port of our own: the launcher's default 29500 may be held by another job.
    return subprocess.run([os.path.join(bin_dir, "deepspeed"), "--master_port", str(free_port()), *args], cwd=root, env=env,
                          capture_output=True, text=True, timeout=timeout)
