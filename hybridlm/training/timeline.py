"""What one profiled training step says about communication: the time in collective kernels, the share of
the step that no compute kernel hides (exposed), which process group each collective ran on, and the
share of the step the device ran any kernel at all (busy).

Pure functions of the profiler's events as kineto exports them (Chrome-trace dicts: ``ph``, ``cat``,
``name``, ``ts``/``dur`` in microseconds, ``args``), so tests feed synthetic timelines; the profiler
session around a step lives in ``monitor.py``.

Which collective a kernel belongs to: PyTorch's NCCL backend wraps each collective in a
``record_param_comms`` CPU op whose arguments name the process group ("Process Group Name", the
``group_name`` of the torch ProcessGroup; "Process Group Ranks", its global ranks, cut after 30 with
"..."), and the collective ("Collective name"). Recent kineto copies those arguments onto the kernels
the op launched; where it does not, the kernel is joined to the op by its "External id", or by its
"correlation" with the runtime launch that the op encloses on the launching thread. A communication
kernel is one whose name says NCCL (``ncclDevKernel_AllReduce_...``, ``ncclKernel_...``): a copy the
collective launched around it is compute.

A process group is given a label (``GroupMap``): TP, CP, DP (DeepSpeed's data-parallel group for
gradients and ZeRO partitions, the DP-only group under CP, the expert-data-parallel one), PP or EP,
first by its name among the run's own groups, then, for groups DeepSpeed made itself (its pipeline
grid's copies of ours, its expert-data-parallel groups, the world group its pipeline sends on), by the
collective and the ranks: point-to-point traffic outside our named groups is the pipeline's, and a group
with the same ranks as one of ours gets its label (an all-to-all preferring EP, then CP). Anything else
is "other": collectives over the whole world or a group of none of these kinds, and NCCL kernels no op
could be found for.

Gloo (CPU runs) records no ``record_param_comms`` in torch 2.13: its profile holds a ``c10d::<op>``
CPU op on the calling thread (no process group among its recorded inputs) and a ``gloo:<op>``
annotation on the group's worker thread while the collective runs. Without a device there are no
kernels, so on CPU the time in collectives is the union of those annotations, all of it "other", and
the exposed and busy shares are not defined (None).
"""
from __future__ import annotations

import bisect
import re
from dataclasses import dataclass, field
from typing import Iterable, Optional

LABELS = ("tp", "cp", "dp", "pp", "ep", "other")
SAMPLED_STEP = "hybridlm.monitor.sampled_step"  # the annotation around a sampled step: the window measured

_COMM_KERNEL = re.compile(r"nccl", re.I)
_P2P = re.compile(r"send|recv", re.I)
_ALL_TO_ALL = re.compile(r"all_?to_?all", re.I)
_META_KEYS = ("Collective name", "Process Group Name", "Process Group Ranks")


# ---------------------------------------------------------------- intervals (microseconds)

def union(intervals: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    """Sorted, disjoint intervals covering the same points."""
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(a, b) for a, b in merged]


def length(intervals: Iterable[tuple[float, float]]) -> float:
    return sum(b - a for a, b in intervals)


def overlap(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Total length of the intersection of two sorted, disjoint interval lists."""
    i = j = 0
    total = 0.0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        total += max(0.0, hi - lo)
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


# ---------------------------------------------------------------- which group a collective ran on

def parse_ranks(text) -> tuple[tuple[int, ...], bool]:
    """"[0, 1, 2]" -> ((0, 1, 2), False); "[0, 1, ..., 63]" (cut by record_param_comms) -> ((0, 1, 63), True)."""
    if isinstance(text, (list, tuple)):
        return tuple(int(r) for r in text), False
    parts = [p.strip() for p in str(text or "").strip("[] ").split(",") if p.strip()]
    cut = "..." in parts
    return tuple(int(p) for p in parts if p != "..."), cut


@dataclass(frozen=True)
class GroupMap:
    """The labels of the run's process groups: by name, and by global ranks (labels in preference order)."""

    names: dict[str, str] = field(default_factory=dict)
    ranks: dict[tuple[int, ...], tuple[str, ...]] = field(default_factory=dict)
    pipeline: bool = False  # PP > 1: point-to-point traffic outside our named groups is the pipeline's

    def label(self, group_name, ranks_text, collective: str = "") -> str:
        name = None if group_name is None else str(group_name)
        if name in self.names:
            return self.names[name]
        p2p = bool(_P2P.search(collective or ""))
        if p2p and self.pipeline:
            return "pp"
        labels = self._by_ranks(ranks_text)
        if not labels:
            return "other"
        preferred = ("ep", "cp") if _ALL_TO_ALL.search(collective or "") else ("pp", "cp") if p2p else ()
        return next((label for label in preferred if label in labels), labels[0])

    def _by_ranks(self, ranks_text) -> tuple[str, ...]:
        ranks, cut = parse_ranks(ranks_text)
        if not ranks:
            return ()
        if not cut:
            return self.ranks.get(ranks, ())
        head, last = ranks[:-1], ranks[-1]
        return next((labels for known, labels in self.ranks.items()
                     if len(known) > len(ranks) and known[:len(head)] == head and known[-1] == last), ())


# ---------------------------------------------------------------- the figures of one step

@dataclass
class StepTimeline:
    """One sampled step on one rank; times in milliseconds, shares of the step's wall time."""

    step_ms: float
    comm_ms: float  # summed durations of the collective kernels: what the profiler's own table totals
    comm_share: float  # the share of the step in which some collective runs (their union)
    exposed_comm_share: Optional[float]  # ... and no compute kernel runs; None without a device timeline
    busy_share: Optional[float]  # the share in which the device runs any kernel; None without one
    by_group: dict[str, float]  # label -> ms; sums to comm_ms
    by_collective: dict[str, dict[str, float]]  # label -> collective name -> ms


def analyse(events: list[dict], groups: GroupMap, window_name: str = SAMPLED_STEP) -> Optional[StepTimeline]:
    """The figures of the step inside the ``window_name`` annotation; None when the events hold no such window."""
    windows = [e for e in events if e.get("name") == window_name and e.get("cat") == "user_annotation" and "dur" in e]
    if not windows:
        return None
    w0 = min(float(e["ts"]) for e in windows)
    w1 = max(float(e["ts"]) + float(e["dur"]) for e in windows)
    if w1 <= w0:
        return None
    kernels = [e for e in events if e.get("cat") == "kernel" and "dur" in e]
    if kernels:
        return _device_step(kernels, events, groups, (w0, w1))
    return _gloo_step(events, (w0, w1))


def _clip(event: dict, window: tuple[float, float]) -> Optional[tuple[float, float]]:
    start, end = float(event["ts"]), float(event["ts"]) + float(event["dur"])
    start, end = max(start, window[0]), min(end, window[1])
    return (start, end) if end > start else None


def _device_step(kernels: list[dict], events: list[dict], groups: GroupMap, window: tuple[float, float]) -> StepTimeline:
    find = _CollectiveFinder(events)
    comm, compute = [], []
    by_group = {label: 0.0 for label in LABELS}
    by_collective: dict[str, dict[str, float]] = {}
    for kernel in kernels:
        span = _clip(kernel, window)
        if span is None:
            continue
        if not _COMM_KERNEL.search(kernel.get("name", "")):
            compute.append(span)
            continue
        comm.append(span)
        meta = find(kernel)
        collective = str(meta.get("Collective name") or _kernel_collective(kernel["name"]))
        label = groups.label(meta.get("Process Group Name"), meta.get("Process Group Ranks"), collective) if meta else "other"
        ms = (span[1] - span[0]) / 1e3
        by_group[label] += ms
        named = by_collective.setdefault(label, {})
        named[collective] = named.get(collective, 0.0) + ms
    step = window[1] - window[0]
    comm_union, compute_union = union(comm), union(compute)
    exposed = length(comm_union) - overlap(comm_union, compute_union)
    busy = length(union(comm + compute))
    return StepTimeline(step_ms=step / 1e3, comm_ms=sum(by_group.values()), comm_share=length(comm_union) / step,
                        exposed_comm_share=exposed / step, busy_share=busy / step, by_group=by_group,
                        by_collective=by_collective)


def _gloo_step(events: list[dict], window: tuple[float, float]) -> StepTimeline:
    spans, by_collective = [], {}
    for e in events:
        if e.get("cat") != "user_annotation" or not str(e.get("name", "")).startswith("gloo:") or "dur" not in e:
            continue
        span = _clip(e, window)
        if span is None:
            continue
        spans.append(span)
        name = e["name"].split(":", 1)[1]
        by_collective[name] = by_collective.get(name, 0.0) + (span[1] - span[0]) / 1e3
    step = window[1] - window[0]
    total = sum(by_collective.values())
    by_group = {label: 0.0 for label in LABELS}
    by_group["other"] = total
    return StepTimeline(step_ms=step / 1e3, comm_ms=total, comm_share=length(union(spans)) / step, exposed_comm_share=None,
                        busy_share=None, by_group=by_group, by_collective={"other": by_collective} if by_collective else {})


def _kernel_collective(name: str) -> str:
    """"ncclDevKernel_AllReduce_Sum_bf16_RING_LL(...)" -> "AllReduce" (a kernel no op could be found for)."""
    match = re.search(r"nccl(?:Dev)?Kernel_([A-Za-z]+)", name)
    return match.group(1) if match else name.split("(")[0][:60]


class _CollectiveFinder:
    """The ``record_param_comms`` arguments of a communication kernel: its own (kineto's copy), else the op's
    with the kernel's External id, else the op enclosing the kernel's launch on the launching thread."""

    def __init__(self, events: list[dict]):
        ops = [e for e in events if e.get("name") == "record_param_comms" and e.get("cat") == "cpu_op" and "dur" in e]
        self.by_external = {e["args"]["External id"]: e["args"] for e in ops if "External id" in e.get("args", {})}
        self.launches = {e["args"]["correlation"]: e for e in events
                         if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})}
        self.by_thread: dict = {}
        for e in sorted(ops, key=lambda e: float(e["ts"])):
            self.by_thread.setdefault(e.get("tid"), []).append(e)
        self.starts = {tid: [float(e["ts"]) for e in ops_] for tid, ops_ in self.by_thread.items()}

    def __call__(self, kernel: dict) -> dict:
        args = kernel.get("args", {})
        if any(key in args for key in _META_KEYS):
            return args
        if args.get("External id") in self.by_external:
            return self.by_external[args["External id"]]
        launch = self.launches.get(args.get("correlation"))
        if launch is None:
            return {}
        at, tid = float(launch["ts"]), launch.get("tid")
        ops = self.by_thread.get(tid, [])
        i = bisect.bisect_right(self.starts.get(tid, []), at) - 1  # one thread's collectives follow each other:
        if i >= 0 and float(ops[i]["ts"]) + float(ops[i]["dur"]) >= at:  # only the last one begun can enclose it
            return ops[i].get("args", {})
        return {}
