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

import gc
import multiprocessing as mp
import os
import pickle
import queue as queue_module
import subprocess
import sys
import time
import traceback
from typing import Any, Callable

# A port free a moment ago, for a program that binds it itself (a launcher's rank 0, a daemon): the port can be taken
# before the program binds it, so such callers retry on EADDRINUSE (``retry_on_port_clash``). Forked ranks need
# neither: their rank 0 binds a port the kernel picks and tells the others (``_child``).
from benchmarks.runner import free_port, port_was_taken  # noqa: F401  (the tests import them from here)


def retry_on_port_clash(launch: Callable[[], subprocess.CompletedProcess], attempts: int = 3) -> subprocess.CompletedProcess:
    """``launch()`` again (it picks a new ``free_port()``) while its output says the port was taken meanwhile."""
    for _ in range(attempts):
        result = launch()
        if result.returncode == 0 or not port_was_taken((result.stdout or "") + (result.stderr or "")):
            return result
    return result


def run_command(argv: list[str], timeout: float = 300, **kwargs) -> subprocess.CompletedProcess:
    """``subprocess.run`` for a command that may start processes of its own (a launcher and its ranks, a worker pool):
    it runs in a session of its own, and every process of that session is killed when it returns or times out, so
    no rank of this test outlives it to load the next test's machine or hold its ports; it starts its own wandb
    service, never one this process holds."""
    kwargs.setdefault("text", True)
    # A wandb run in this process (another test's) leaves WANDB_SERVICE in os.environ: a launched job would log
    # through that service, which resolves the job's relative paths against this process's folder (the checkout).
    kwargs["env"] = {k: v for k, v in (kwargs.get("env") or os.environ).items() if k != "WANDB_SERVICE"}
    check = kwargs.pop("check", False)
    pipe = subprocess.PIPE if kwargs.pop("capture_output", True) else None
    with subprocess.Popen(argv, start_new_session=True, stdout=pipe, stderr=pipe, **kwargs) as proc:
        try:
            stdout, stderr = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            _kill_session(proc.pid)
            stdout, stderr = proc.communicate()
            raise subprocess.TimeoutExpired(argv, timeout, output=stdout, stderr=stderr) from None
        finally:
            _kill_session(proc.pid)
    result = subprocess.CompletedProcess(argv, proc.returncode, stdout, stderr)
    if check:
        result.check_returncode()
    return result


def _kill_session(pid: int) -> None:
    try:
        os.killpg(pid, 9)
    except (ProcessLookupError, PermissionError):
        pass


def _rendezvous(rank: int, world: int, port, deadline: float):
    """Rank 0 serves the c10d store on a port the kernel picks (no port seen free and then taken by another process)
    and shares the number; every rank then joins that store as a client (TORCHELASTIC_USE_AGENT_STORE, as torchrun's
    workers do). The server lives in rank 0, never in the test process: a store thread there would be inherited
    mid-lock by the next test's forked ranks."""
    store = None
    if rank == 0:
        from torch.distributed import TCPStore
        store = TCPStore("127.0.0.1", 0, world_size=world, is_master=True, wait_for_workers=False)
        port.value = store.port
    while port.value == 0:
        if time.monotonic() > deadline:
            raise TimeoutError("rank 0 never served the rendezvous store")
        time.sleep(0.01)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port.value), TORCHELASTIC_USE_AGENT_STORE="True")
    return store


def _child(rank: int, world: int, port, fn: Callable, args: tuple, results) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    import torch
    torch.set_num_threads(1)
    try:
        store = _rendezvous(rank, world, port, time.monotonic() + 120)  # noqa: F841 (rank 0 serves while fn runs)
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
    port = ctx.Value("i", 0)
    procs = [ctx.Process(target=_child, args=(r, world, port, fn, args, results), daemon=True) for r in range(world)]
    # The ranks share this process's pages until they write to them, and a collection in a rank writes to every
    # object it visits: with everything here frozen first, a rank's collections visit only its own objects (CPython's
    # advice for fork without exec). ~10% less CPU per forked test (page faults); unfrozen at once, so this process
    # collects as before. A rank still collects all it allocates itself.
    gc.freeze()
    try:
        for p in procs:
            p.start()
            p.rendezvous_port = port  # alive until the ranks are done: a spawned rank unpickles it after its start
    finally:
        gc.unfreeze()
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
    # a port of our own (the launcher's default 29500 may be held by another job), again if taken before rank 0 binds it
    return retry_on_port_clash(lambda: run_command([os.path.join(bin_dir, "deepspeed"), "--master_port", str(free_port()), *args],
                                                   cwd=root, env=env, timeout=timeout))
