"""Build-and-load of an op builder that many processes may call at once, and that survives
builds killed half-way.

torch.utils.cpp_extension serialises builds of one extension with a "baton": a ``lock`` file
in the build directory, created with O_EXCL and deleted when the build ends. A build killed
in between (a Ctrl-C, a job hitting its time limit, an OOM-killed rank) leaves the file
behind, and every later load of that extension then waits for it forever.

Here each build and load runs under an ``fcntl.flock`` on a file of our own in the build
directory: the kernel releases it when its holder dies, however it dies. Whoever holds it is
the only process of the node working on that extension, so a baton found then is stale and
is removed. Ranks of one node therefore compile an op once: the first builds, the others
wait on the flock and then load the cached library.

A failed build is recorded in the build directory too, and a process that started before
the failure was recorded (a sibling rank of the same job) reports it instead of compiling
the same broken sources again; a later job tries afresh.
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import time
from dataclasses import dataclass
from typing import Callable, Optional

import psutil
from deepspeed.ops.op_builder.builder import OpBuilder

FLOCK_NAME = "hybridlm_build.flock"
FAILURE_NAME = "hybridlm_build_failed.log"
BATON_NAME = "lock"  # torch.utils.cpp_extension's FileBaton in the build directory


@dataclass
class BuildOutcome:
    """What happened when an op was asked for: ``module`` is None unless it loaded."""

    module: Optional[object]
    status: str  # "built", "cached", "loaded" (already in this process), "failed", "incompatible"
    detail: str  # one phrase for the log: "built in 41 s", the compiler's first error lines, ...

    @property
    def ok(self) -> bool:
        return self.module is not None


def build_directory(name: str, create: bool = True) -> str:
    """Where torch.utils.cpp_extension builds extension ``name`` (TORCH_EXTENSIONS_DIR/name by default)."""
    from torch.utils.cpp_extension import _get_build_directory
    path = os.path.join(_get_build_directory("", verbose=False), name)  # "" gives the root (created if missing)
    if create:
        os.makedirs(path, exist_ok=True)
    return path


@contextlib.contextmanager
def exclusive(path: str, on_wait: Optional[Callable[[], None]] = None, on_unsupported: Optional[Callable[[str], None]] = None):
    """Hold an exclusive flock on ``path`` (created if missing); released by the kernel if we die.
    On a file system without flock (some network mounts) it runs unlocked, after ``on_unsupported``.
    Yields whether the lock is held."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if on_wait is not None:
                on_wait()
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError as e:
            if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                raise
            if on_unsupported is not None:
                on_unsupported(f"no file locks on {os.path.dirname(path)} ({e.strerror}); building unlocked")
            yield False
            return
        yield True
    finally:
        os.close(fd)  # closing the descriptor releases the lock


def compiler_error(message: str, max_lines: int = 3) -> str:
    """The first lines of a failed build's output that name an error (else its last lines)."""
    lines = [ln.strip() for ln in message.splitlines() if ln.strip()]
    noise = ("Error building extension", "FAILED:", "ninja: build stopped", "[")  # torch's wrapper, ninja's lines
    errors = [ln for ln in lines if "error" in ln.lower() and not any(n in ln[:40] for n in noise)]
    chosen = errors[:max_lines] or lines[-max_lines:]
    return " | ".join(ln if len(ln) <= 300 else ln[:297] + "..." for ln in chosen)


def _started_at() -> float:
    return psutil.Process().create_time()


def _mtime(path: str) -> Optional[int]:
    try:
        return os.stat(path).st_mtime_ns
    except FileNotFoundError:
        return None


def build_and_load(builder: OpBuilder, *, log: Callable[[str], None] = lambda _: None) -> BuildOutcome:
    """JIT-build (or load from the cache) ``builder``'s extension; never raises for a failed build."""
    if builder.name in OpBuilder._loaded_ops:
        return BuildOutcome(OpBuilder._loaded_ops[builder.name], "loaded", "already loaded in this process")
    if not builder.is_compatible():
        return BuildOutcome(None, "incompatible", builder.error_log or "not compatible with this machine")
    directory = build_directory(builder.name)
    library = os.path.join(directory, f"{builder.name}.so")
    failure_log = os.path.join(directory, FAILURE_NAME)
    wait_note = lambda: log(f"{builder.name}: another process is building it; waiting for that build")  # noqa: E731
    with exclusive(os.path.join(directory, FLOCK_NAME), on_wait=wait_note, on_unsupported=log) as locked:
        failed_at = _mtime(failure_log)
        if failed_at is not None and failed_at / 1e9 >= _started_at():
            with open(failure_log) as f:
                return BuildOutcome(None, "failed", f"{compiler_error(f.read())} (full log: {failure_log})")
        baton = os.path.join(directory, BATON_NAME)
        if locked and os.path.exists(baton):  # only a lock holder knows no live build owns it
            os.remove(baton)
            log(f"{builder.name}: removed a stale build lock left by a killed build ({baton})")
        before = _mtime(library)
        started = time.monotonic()
        try:
            module = builder.load(verbose=False)
        except Exception as e:  # noqa: BLE001 - a compiler error, a missing toolkit, an import error: all fall back
            text = f"{type(e).__name__}: {e}"
            _write_atomically(failure_log, text)
            return BuildOutcome(None, "failed", f"{compiler_error(text)} (full log: {failure_log})")
        seconds = time.monotonic() - started
        if os.path.exists(failure_log):
            os.remove(failure_log)
    if before is not None and _mtime(library) == before:
        return BuildOutcome(module, "cached", "loaded from cache")
    return BuildOutcome(module, "built", f"built in {seconds:.0f} s")


def _write_atomically(path: str, text: str) -> None:
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)
