"""One run per --save directory (issue 47, item 2): rank 0 locks it before any process group exists, a
second run on it is refused in one sentence naming the other run's host and pid, the lock is released at
exit, and a lock left by a job that died is recognised as stale, taken over and named."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

from harness import run_ranks
from oracle import TINY, ds_config
from test_user_mistakes import _main

FLAGS = TINY + ds_config("zero0") + ["--train-iters", "1"]


def test_a_second_lock_on_a_locked_directory_is_refused_naming_the_holders_host_and_pid(tmp_path):
    from hybridlm.config import ConfigError
    from hybridlm.training.save_lock import SaveLock
    held = SaveLock.acquire(str(tmp_path))
    try:
        with pytest.raises(ConfigError) as caught:
            SaveLock.acquire(str(tmp_path))
    finally:
        held.release()
    message = str(caught.value)
    assert f"pid {os.getpid()} on {socket.gethostname()}" in message and f"--save {tmp_path}" in message
    assert "\n" not in message


def test_a_released_lock_leaves_nothing_behind_and_can_be_taken_again(tmp_path):
    from hybridlm.training.save_lock import LOCK_FILE, SaveLock
    SaveLock.acquire(str(tmp_path)).release()
    assert not (tmp_path / LOCK_FILE).exists()
    again = SaveLock.acquire(str(tmp_path))
    assert again.note is None
    again.release()


def test_a_lock_left_by_a_dead_job_is_taken_over_and_named(tmp_path):
    from hybridlm.training.save_lock import LOCK_FILE, SaveLock
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (tmp_path / LOCK_FILE).write_text(json.dumps({"host": "node7", "pid": dead.pid, "started": "2026-01-01 00:00:00"}))
    lock = SaveLock.acquire(str(tmp_path))
    try:
        assert f"took over the lock left by pid {dead.pid} on node7" in lock.note
        assert json.loads((tmp_path / LOCK_FILE).read_text())["pid"] == os.getpid()
    finally:
        lock.release()


def test_a_run_on_a_save_directory_in_use_is_refused_before_any_process_group_and_writes_nothing(tmp_path):
    """The issue's two runs with one --save: the second stops in one sentence (exit 2) and the first's files stay
    its own; once the first has ended (its lock released), the same command trains and releases the lock."""
    from hybridlm.training.save_lock import LOCK_FILE, SaveLock
    flags = FLAGS + ["--save", str(tmp_path)]
    other = SaveLock.acquire(str(tmp_path))  # the first run, alive
    try:
        code, _, err, process_group = run_ranks(1, _main, flags)[0]
    finally:
        other.release()
    assert (code, process_group) == (2, False)
    assert err.startswith("error: --save") and f"pid {os.getpid()} on {socket.gethostname()}" in err and err.count("\n") == 1
    assert sorted(os.listdir(tmp_path)) == []
    code, _, _, _ = run_ranks(1, _main, flags)[0]
    assert code == 0 and (tmp_path / "latest").read_text() == "global_step1" and not (tmp_path / LOCK_FILE).exists()


def test_without_flock_a_lock_of_the_same_slurm_job_is_stale_and_one_of_another_host_is_held(monkeypatch):
    """File systems without flock (Lustre without its flock option): a requeued Slurm job takes over its own earlier
    run's lock on any node; another host's lock is held; this host's is stale once its process is gone."""
    from hybridlm.training.save_lock import _held_without_flock
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    assert not _held_without_flock({"host": "node7", "pid": 1, "slurm_job": "4242"})
    assert _held_without_flock({"host": "node7", "pid": 1, "slurm_job": "4241"})
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    assert not _held_without_flock({"host": socket.gethostname(), "pid": dead.pid})
    assert _held_without_flock({"host": socket.gethostname(), "pid": os.getpid()})
