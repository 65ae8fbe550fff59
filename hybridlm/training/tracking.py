"""Experiment tracking (Weights & Biases, TensorBoard) for the training loop, rank 0 only.

Every rank computes the same averaged loss, so one writer is enough; the others would only
create duplicate runs and event files. ``build_trackers`` therefore returns an empty list
on any rank but 0, and the loop calls ``log_all`` / ``close_all`` on every rank without
asking who it is.

A resumed job should continue the *same* W&B run, not start a new one with a gap in its
curves: ``WandbTracker.run_id`` is stored in the checkpoint and handed back as
``wandb_resume_id`` (``wandb.init(id=..., resume="allow")``).

The backends are imported lazily, so a user who asks for neither needs neither installed;
``check_backends`` lets config validation refuse a missing one on every rank, before any
process group exists.
"""
from __future__ import annotations

import importlib.util
import numbers
import os
from typing import Any, Iterable, Optional

from ..config import ConfigError


class Tracker:
    """What the loop needs from a backend: log a dict of metrics at a step, then close."""

    def log(self, metrics: dict[str, Any], step: int) -> None:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError


class WandbTracker(Tracker):
    """One W&B run; ``WANDB_MODE=offline`` keeps it on disk (tests, clusters without internet)."""

    def __init__(self, project: str, name: Optional[str], directory: Optional[str], config: dict,
                 resume_id: Optional[str] = None):
        import wandb

        if directory:
            os.makedirs(directory, exist_ok=True)  # wandb refuses a missing dir
        # resume="allow": continue the run if it exists, create it with this id otherwise
        # (an offline run never reached the server, so "must" would fail there).
        self.run = wandb.init(project=project, name=name, dir=directory, config=config,
                              id=resume_id, resume="allow" if resume_id else None)

    @property
    def run_id(self) -> str:
        """Store this in the checkpoint; pass it back as ``resume_id`` to continue the run."""
        return self.run.id

    def log(self, metrics: dict[str, Any], step: int) -> None:
        # None means "not measured" (MFU on a CPU); wandb would store it as null, giving an
        # empty chart and a column of nulls in the run table.
        self.run.log({k: v for k, v in metrics.items() if v is not None}, step=step)

    def close(self) -> None:
        self.run.finish()


class TensorBoardTracker(Tracker):
    """Event files under ``log_dir``: one scalar series per numeric metric."""

    def __init__(self, log_dir: str):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=log_dir)

    def log(self, metrics: dict[str, Any], step: int) -> None:
        for key, value in metrics.items():
            # add_scalar only takes numbers; None and strings have no place on a curve.
            if isinstance(value, numbers.Real):
                self.writer.add_scalar(key, value, global_step=step)

    def close(self) -> None:
        self.writer.flush()
        self.writer.close()


def check_backends(*, wandb_project: Optional[str], tensorboard_dir: Optional[str]) -> None:
    """Raise ConfigError if a requested backend is not installed.

    ``build_trackers`` runs on rank 0 after the process group exists, where an error would
    leave the other ranks waiting in a collective; call this on every rank during config
    validation so a missing package ends the job in one sentence everywhere. It asks whether
    the package is installed without importing it: only rank 0 logs, and importing wandb cost
    every other rank about a second of CPU at start-up for nothing (a tiny 4-rank CPU job).
    """
    for flag, value, package in (("--wandb-project", wandb_project, "wandb"),
                                 ("--tensorboard-dir", tensorboard_dir, "tensorboard")):
        if value and importlib.util.find_spec(package) is None:
            raise ConfigError(f"{flag} {value} needs the {package} package; "
                              f"pip install {package}, or omit {flag}.")


def build_trackers(*, rank: int, wandb_project: Optional[str], wandb_name: Optional[str],
                   wandb_dir: Optional[str], tensorboard_dir: Optional[str], config: dict,
                   wandb_resume_id: Optional[str] = None) -> list[Tracker]:
    """One tracker per configured backend on rank 0; nothing elsewhere.

    Call it once the checkpoint is loaded, so the stored W&B run id is known.
    """
    if rank != 0:
        return []
    check_backends(wandb_project=wandb_project, tensorboard_dir=tensorboard_dir)
    trackers: list[Tracker] = []
    if wandb_project:
        trackers.append(WandbTracker(wandb_project, wandb_name, wandb_dir, config, wandb_resume_id))
    if tensorboard_dir:
        trackers.append(TensorBoardTracker(tensorboard_dir))
    return trackers


def log_all(trackers: Iterable[Tracker], metrics: dict[str, Any], step: int) -> None:
    for tracker in trackers:
        tracker.log(metrics, step)


def close_all(trackers: Iterable[Tracker]) -> None:
    for tracker in trackers:
        tracker.close()


def wandb_run_id(trackers: Iterable[Tracker]) -> Optional[str]:
    """The W&B run id to save in a checkpoint, or None (no W&B, or not rank 0)."""
    return next((t.run_id for t in trackers if isinstance(t, WandbTracker)), None)
