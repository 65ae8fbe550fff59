"""One run per ``--save`` directory: rank 0 holds a lock file there from start-up to exit.

Two runs saving to the same directory would interleave their checkpoints (one run's ``config.yaml``,
the other's ``global_step*``) and both exit 0. The lock is an ``flock`` on ``<save>/.hybridlm.lock``,
which also records who holds it (host, pid, start time) for the refusal. The kernel drops an ``flock``
when its process dies, however it dies, so a lock file left by a killed job is recognised as stale
(its lock is free) and taken over, with one line naming the job that left it. Where the file system
does not support ``flock`` (Lustre without its flock option), a lock of this host is stale when its
process is gone, one of the same Slurm job (a requeue) is stale, and one of another host is refused with
the file to delete.
"""
from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import time

from ..config import ConfigError

LOCK_FILE = ".hybridlm.lock"


class SaveLock:
    """The lock of one ``--save`` directory, held by this process until ``release``."""

    def __init__(self, path: str, fd: int, note: str | None):
        self.path, self._fd = path, fd
        self.note = note  # a line for the log when a stale lock was taken over, else None

    @classmethod
    def acquire(cls, directory: str) -> "SaveLock":
        """Take the lock of ``directory`` (created if missing), or raise ConfigError naming the run that holds it."""
        os.makedirs(directory, exist_ok=True)
        path = os.path.join(directory, LOCK_FILE)
        while True:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            holder = _read_holder(fd)
            try:
                _flock(fd, holder, path)
            except BaseException:
                os.close(fd)
                raise
            if _same_file(fd, path):  # not unlinked by its releasing holder meanwhile
                break
            os.close(fd)
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(_this_process()).encode(), 0)
        os.fsync(fd)
        note = None
        if holder:
            note = f"--save {directory}: took over the lock left by pid {holder.get('pid')} on {holder.get('host')} (started " \
                   f"{holder.get('started', '?')}), a run that ended without releasing it."
        return cls(path, fd, note)

    @classmethod
    def for_run(cls, cfg) -> "SaveLock | None":
        """Rank 0 of a run with --save locks it before any process group exists, so that a second run on it is refused
        in one sentence (the other ranks stop with it: every launcher ends a job one of whose ranks exited)."""
        from ..config import rank_from_env
        if not cfg.train.save or rank_from_env() != 0:
            return None
        lock = cls.acquire(cfg.train.save)
        if lock.note:
            print(f"hybridlm: {lock.note}", flush=True)
        return lock

    def release(self) -> None:
        """Remove the lock file, then drop the lock (in that order: a waiting run then opens a new file)."""
        if self._fd is None:
            return
        try:
            if _same_file(self._fd, self.path):
                os.unlink(self.path)
        except OSError:
            pass
        os.close(self._fd)
        self._fd = None


def _flock(fd: int, holder: dict, path: str) -> None:
    """Lock ``fd`` without waiting; ConfigError when a live run holds it."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return
    except OSError as e:
        if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            if not _held_without_flock(holder):
                return  # no flock here: a lock of this host whose process is gone
            raise ConfigError(f"--save {os.path.dirname(path)} is locked by pid {holder.get('pid')} on {holder.get('host')} "
                              f"and this file system cannot tell whether that run is alive (flock: {e.strerror}); if it "
                              f"has ended, delete {path}.") from None
    raise ConfigError(f"--save {os.path.dirname(path)} is in use by another run (pid {holder.get('pid', '?')} on "
                      f"{holder.get('host', '?')}, started {holder.get('started', '?')}): two runs saving to one directory "
                      "would mix their checkpoints; give this run another --save, or wait for that one to end.")


def _held_without_flock(holder: dict) -> bool:
    """Without flock: a lock of another host counts as held, unless the same Slurm job wrote it (a requeued job runs
    again only once its earlier run has ended); one of this host while its pid lives."""
    if not holder:
        return False
    if holder.get("slurm_job") and holder.get("slurm_job") == os.environ.get("SLURM_JOB_ID"):
        return False
    if holder.get("host") != socket.gethostname():
        return True
    try:
        os.kill(int(holder.get("pid", -1)), 0)
    except ProcessLookupError:
        return False
    except (PermissionError, ValueError):
        return True
    return True


def _read_holder(fd: int) -> dict:
    """Who wrote the lock file ({} for a new or unreadable one)."""
    try:
        return json.loads(os.pread(fd, 4096, 0).decode() or "{}")
    except (ValueError, UnicodeDecodeError):
        return {}


def _same_file(fd: int, path: str) -> bool:
    try:
        return os.stat(path).st_ino == os.fstat(fd).st_ino
    except FileNotFoundError:
        return False


def _this_process() -> dict:
    mine = {"host": socket.gethostname(), "pid": os.getpid(), "started": time.strftime("%Y-%m-%d %H:%M:%S")}
    if os.environ.get("SLURM_JOB_ID"):
        mine["slurm_job"] = os.environ["SLURM_JOB_ID"]
    return mine
