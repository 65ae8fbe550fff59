"""A save that fails says why in one sentence on every rank, instead of a torch-internal traceback on some.

A full disk, a missing permission or an I/O error can hit any rank at any file of a checkpoint, and a rank
that raised there would leave the others waiting in DeepSpeed's next collective of the save. So while a
checkpoint is written each rank only records its first failed write (``WriteRecorder``: DeepSpeed's
checkpoint engine writes every DeepSpeed file, ``attempt`` writes ours) and skips its later files; once every
rank has gone through the whole save, ``agreed_failure`` tells every rank whether any failed and what the
first failing rank's sentence was.
"""
from __future__ import annotations

import errno
import os
import shutil

import torch
import torch.distributed as dist


class CheckpointSaveFailed(RuntimeError):
    """A checkpoint could not be written; the message is one sentence (the directory, the cause, the free space)."""


class WriteRecorder:
    """Stands in for DeepSpeed's checkpoint engine during one save: writes go through it, a failed one is recorded
    (the first only) and every later write of this rank is skipped, so that the collectives still run."""

    def __init__(self, engine):
        self._engine, self._inner = engine, engine.checkpoint_engine
        self.error: tuple[str, BaseException] | None = None  # (the file, what went wrong)

    def __enter__(self) -> "WriteRecorder":
        self._engine.checkpoint_engine = self
        return self

    def __exit__(self, *exc) -> None:
        self._engine.checkpoint_engine = self._inner

    def __getattr__(self, name):  # create, load, commit, is_decoupled, ...: DeepSpeed's engine as it is
        return getattr(self._inner, name)

    def save(self, state_dict, path: str):
        return self.attempt(path, self._inner.save, state_dict, path)

    def makedirs(self, path: str, exist_ok: bool = False):
        return self.attempt(path, self._inner.makedirs, path, exist_ok=exist_ok)

    def attempt(self, path: str, write, *args, **kwargs):
        """``write(*args, **kwargs)``, unless an earlier write failed; records an I/O failure instead of raising it."""
        if self.error is not None:
            return None
        try:
            return write(*args, **kwargs)
        except (OSError, RuntimeError) as e:  # torch.save reports a failed write as a RuntimeError of its zip writer
            self.error = (path, e)
            return None


def agreed_failure(recorder: WriteRecorder, directory: str) -> str | None:
    """On every rank (a collective): the sentence of the lowest rank whose writes failed, or None when none did."""
    mine = None if recorder.error is None else describe(recorder.error[0], recorder.error[1], directory)
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return mine
    world = dist.get_world_size()
    first = torch.tensor([dist.get_rank() if mine is not None else world], device=_device())
    dist.all_reduce(first, op=dist.ReduceOp.MIN)
    if int(first.item()) == world:
        return None
    sentence = [mine]
    dist.broadcast_object_list(sentence, src=int(first.item()), device=_device())
    return sentence[0]


def _device():
    from deepspeed.accelerator import get_accelerator
    return get_accelerator().current_device_name()


def describe(path: str, error: BaseException, directory: str) -> str:
    """What failed, in words a user can act on: the file, the cause (the OS's, or the free space when torch hides it)."""
    free = free_bytes(directory)
    if isinstance(error, OSError) and error.errno is not None:
        cause = os.strerror(error.errno) if error.errno != errno.EFBIG else "File too large (a file-size limit or a full quota)"
    elif free is not None and free < (64 << 20):
        cause = "No space left on device"
    else:
        cause = f"the write failed ({str(error).splitlines()[0][:160]})"
    there = f"{human_bytes(free)} free there" if free is not None else "free space unknown"
    return f"writing {os.path.relpath(path, directory)}: {cause} ({there})"


def free_bytes(directory: str) -> int | None:
    try:
        return shutil.disk_usage(directory).free
    except OSError:
        return None


def folder_bytes(folder: str) -> int:
    """The size of the files under ``folder`` (what a checkpoint takes on disk, roughly)."""
    total = 0
    for root, _, files in os.walk(folder):
        for name in files:
            try:
                total += os.path.getsize(os.path.join(root, name))
            except OSError:
                pass
    return total


def human_bytes(count: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if count < 1024 or unit == "TiB":
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1024
    return f"{count} B"
