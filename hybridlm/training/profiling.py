"""``--profile-step-range A,B``: a torch.profiler trace of a few chosen training iterations.

Profiling every step would slow the whole run and write gigabytes, and the first steps are
unrepresentative (allocator warm-up, DeepSpeed bucket set-up), so the user names a window.
``StepProfiler.step(iteration)`` is called after each optimizer step with the number of
steps completed: the profiler starts when that number reaches A and stops when it reaches
B, so the trace holds iterations A+1 .. B, each under a ``ProfilerStep#<iteration>``
marker. Every rank writes its own ``trace_rank{r}_steps{A}-{B}.json`` (open it in
Perfetto or chrome://tracing): pipeline stages and TP ranks do different work. Rank 0 also
prints a summary: GPU time by kind of kernel, the heaviest kernels, and the idle GPU time
summed by where the host was (the training loop marks its phases ``hybridlm.forward``,
``hybridlm.backward``, ``hybridlm.step``, ``hybridlm.next_batch`` and ``hybridlm.log``).
"""
from __future__ import annotations

import bisect
import json
import os
import re
from types import SimpleNamespace
from typing import Optional

import torch
from torch.profiler import ProfilerActivity, profile

from ..config import ConfigError
from .timeline import length as _length, overlap as _overlap, union as _union


class StepProfiler:
    """Starts and stops one torch.profiler session around a window of training iterations."""

    def __init__(self, step_range: Optional[str], output_dir: str, rank: int):
        self.range = self.parse(step_range)
        self.output_dir, self.rank = output_dir, rank
        self._profile: Optional[profile] = None

    @staticmethod
    def parse(step_range: Optional[str]) -> Optional[tuple[int, int]]:
        """"A,B" -> (A, B); None -> None. Call it during config validation to fail early."""
        if step_range is None:
            return None
        error = ConfigError(f"--profile-step-range {step_range!r} must be two integers A,B with 0 <= A < B, e.g. 10,12.")
        try:
            start, stop = (int(part) for part in step_range.split(","))
        except ValueError:
            raise error from None
        if not 0 <= start < stop:
            raise error
        return start, stop

    @property
    def trace_path(self) -> str:
        start, stop = self.range
        return os.path.join(self.output_dir, f"trace_rank{self.rank}_steps{start}-{stop}.json")

    def step(self, iteration: int) -> Optional[str]:
        """Call once before the loop and once after every iteration; returns the trace path when one is written.

        The call before the loop (with the starting iteration) is what lets A=0, or A equal to
        a resumed run's first iteration, start the profiler before the first profiled step.
        """
        if self.range is None:
            return None
        start, stop = self.range
        if self._profile is None:
            if iteration == start:
                self._start(iteration)
        elif iteration >= stop:
            return self.close()
        else:
            self._profile.step()
        return None

    def close(self) -> Optional[str]:
        """Stop and export if still profiling (the run ended inside the window); returns the trace path.

        The trace then ends with an empty marker for the iteration that never ran.
        """
        if self._profile is None:
            return None
        self._profile.stop()
        os.makedirs(self.output_dir, exist_ok=True)
        self._profile.export_chrome_trace(self.trace_path)
        summary = summarize_trace(self.trace_path)
        if summary:
            with open(self.trace_path.replace(".json", "_summary.txt"), "w") as f:
                f.write(format_summary(summary) + "\n")
            if self.rank == 0:
                print(f"profile of steps {self.range[0] + 1}-{self.range[1]} (rank 0):\n{format_summary(summary)}", flush=True)
        self._profile = None
        return self.trace_path

    def _start(self, iteration: int) -> None:
        activities = [ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(ProfilerActivity.CUDA)
        # A schedule that always records only exists to make the profiler mark steps;
        # numbering them by training iteration makes the trace match the log lines.
        self._profile = profile(activities=activities, record_shapes=True, with_stack=False,
                                schedule=lambda _: torch.profiler.ProfilerAction.RECORD)
        self._profile.step_num = iteration + 1
        self._profile.start()


# ---------------------------------------------------------------- where the time went

_CATEGORIES = (  # first match wins; names of CUDA kernels as the profiler records them
    ("communication", re.compile(r"nccl|all_?reduce|all_?gather|reduce_?scatter|sendrecv", re.I)),
    ("attention", re.compile(r"flash|fmha|cudnn|attention|sdpa", re.I)),
    ("matmul", re.compile(r"gemm|cutlass|nvjet|xmma|cublas|wgmma|matmul", re.I)),
    ("optimizer", re.compile(r"adam|multi_tensor|foreach|lamb(?!da)", re.I)),  # not the "lambda" in elementwise kernels
)


def summarize_trace(path: str) -> dict:
    """``summarize`` over an exported chrome trace: kernels are the events of category
    "kernel" (the stable part of the format across torch versions), steps the
    ``ProfilerStep#`` annotations; times in microseconds."""
    with open(path) as f:
        trace = json.load(f)
    events, host = [], []
    for e in trace.get("traceEvents", []):
        if e.get("ph") != "X" or "dur" not in e:
            continue
        step_marker = e.get("name", "").startswith("ProfilerStep#") and e.get("cat") != "gpu_user_annotation"
        if e.get("cat") == "kernel" or step_marker:
            device = "CUDA" if e.get("cat") == "kernel" else "CPU"
            events.append(SimpleNamespace(name=e["name"], device_type=SimpleNamespace(name=device),
                                          time_range=SimpleNamespace(start=float(e["ts"]), end=float(e["ts"]) + float(e["dur"]))))
        if e.get("cat") in ("cpu_op", "user_annotation", "kernel", "cuda_runtime"):
            host.append(e)
    summary = summarize(events)
    if summary:
        summary["idle sites"] = idle_sites(host)
    return summary


IDLE_SITES = 6


def idle_sites(trace_events: list[dict]) -> dict[str, list[tuple[float, int, float, str]]]:
    """The profiled steps' idle GPU time, summed two ways, most idle first, as (ms per step,
    gaps per step, longest gap ms, site):

    - "ran dry": where the main thread was when the GPU finished its last queued kernel (its
      outermost annotation > innermost op or runtime call: a ``cudaStreamSynchronize`` there
      is a host sync that let the queue empty);
    - "refilled": where the kernel that ended the gap was launched (the main thread's
      outermost annotation > the launching op, on autograd's thread in backward); the gap
      still open at the end of the profiled steps counts as "(after the steps)".

    Host-bound steps idle in many gaps too short to see one by one; summed by site they say
    which host work to shorten, move or stop waiting on. Gaps between back-to-back kernels
    (a few microseconds each) count too: thousands of tiny gaps under one site are launch
    latency, not a stall."""
    kernels = sorted((float(e["ts"]), float(e["ts"]) + float(e["dur"]), e) for e in trace_events if e["cat"] == "kernel")
    steps = [e for e in trace_events if e["name"].startswith("ProfilerStep#") and e["cat"] == "user_annotation"]
    if not kernels or not steps:
        return {}
    main_thread = steps[0].get("tid")
    window = (min(float(e["ts"]) for e in steps), max(float(e["ts"]) + float(e["dur"]) for e in steps))
    ops: dict = {}  # by thread: backward's ops run on autograd's device thread, not the main one
    for e in trace_events:
        if e["cat"] in ("cpu_op", "user_annotation", "cuda_runtime") and not e["name"].startswith("ProfilerStep#"):
            ops.setdefault(e.get("tid"), []).append(e)
    ops = {thread: _HostOps(events) for thread, events in ops.items()}
    no_ops = _HostOps([])
    main_ops = ops.get(main_thread, no_ops)
    launches = {e.get("args", {}).get("correlation"): e for e in trace_events if e["cat"] == "cuda_runtime"}

    def site(outer_at: float, thread, inner_at: float, runtime_calls: bool) -> str:
        outer = [e["name"] for e in main_ops.at(outer_at) if e["cat"] != "cuda_runtime"]
        inner = [e["name"] for e in ops.get(thread, no_ops).at(inner_at) if runtime_calls or e["cat"] != "cuda_runtime"]
        return f"{outer[0] if outer else '(between ops)'} > {inner[-1] if inner else '(no op)'}"

    dry: dict[str, list[float]] = {}
    refilled: dict[str, list[float]] = {}
    busy_until = window[0]
    for start, end, kernel in kernels + [(window[1], window[1], None)]:
        if busy_until < min(start, window[1]):
            gap = min(start, window[1]) - busy_until
            dry.setdefault(site(busy_until, main_thread, busy_until, True), []).append(gap)
            launch = launches.get(kernel.get("args", {}).get("correlation")) if kernel and start <= window[1] else None
            where = site(float(launch["ts"]), launch.get("tid"), float(launch["ts"]), False) if launch else "(after the steps)"
            refilled.setdefault(where, []).append(gap)
        busy_until = max(busy_until, end)
    n = len(steps)

    def ranked(sites: dict) -> list:
        top = sorted(sites.items(), key=lambda item: -sum(item[1]))[:IDLE_SITES]
        return [(sum(gaps) / 1e3 / n, max(1, len(gaps) // n), max(gaps) / 1e3, where) for where, gaps in top]
    return {"ran dry": ranked(dry), "refilled": ranked(refilled)}


class _HostOps:
    """One thread's host events, for "which events run at time t" over a long trace: the few
    long ones (annotations, whole passes) are checked one by one, the many short ones by
    bisection over their sorted starts."""

    LONG_US = 1000.0

    def __init__(self, events: list[dict]):
        self.long = [e for e in events if float(e["dur"]) > self.LONG_US]
        self.short = sorted((e for e in events if float(e["dur"]) <= self.LONG_US), key=lambda e: float(e["ts"]))
        self.starts = [float(e["ts"]) for e in self.short]

    def at(self, t: float) -> list[dict]:
        """The events running at ``t``, outermost first."""
        hits = [e for e in self.long if float(e["ts"]) <= t <= float(e["ts"]) + float(e["dur"])]
        i = bisect.bisect_right(self.starts, t) - 1
        while i >= 0 and self.starts[i] >= t - self.LONG_US:
            if t <= self.starts[i] + float(self.short[i]["dur"]):
                hits.append(self.short[i])
            i -= 1
        return sorted(hits, key=lambda e: (float(e["ts"]), -float(e["dur"])))


def summarize(events) -> dict:
    """Per-step GPU time by kind of kernel, exposed communication and idle GPU time (ms).

    Communication is "exposed" where no compute kernel runs at the same time; the GPU is
    "idle" inside the profiled steps when no kernel runs at all (host overhead, waits on
    the CPU, pipeline bubbles). Empty on a CPU-only run (no device kernels)."""
    steps = [e for e in events if e.name.startswith("ProfilerStep#") and e.device_type.name == "CPU"]
    kernels = [e for e in events if getattr(e, "device_type", None) is not None and e.device_type.name == "CUDA"]
    if not steps or not kernels:
        return {}
    window = (min(e.time_range.start for e in steps), max(e.time_range.end for e in steps))
    by_kind: dict[str, list] = {}
    for e in kernels:
        start, end = max(e.time_range.start, window[0]), min(e.time_range.end, window[1])
        if end <= start:
            continue
        kind = next((name for name, pattern in _CATEGORIES if pattern.search(e.name)), "other kernels")
        by_kind.setdefault(kind, []).append((start, end))
    n = len(steps)
    by_name: dict[str, float] = {}
    for e in kernels:
        start, end = max(e.time_range.start, window[0]), min(e.time_range.end, window[1])
        if end > start:
            name = _short_name(e.name)
            by_name[name] = by_name.get(name, 0.0) + end - start
    busy = _union([iv for ivs in by_kind.values() for iv in ivs])
    compute = _union([iv for kind, ivs in by_kind.items() if kind != "communication" for iv in ivs])
    comm = _union(by_kind.get("communication", []))
    summary = {"steps": n, "step ms": (window[1] - window[0]) / 1e3 / n}
    for kind in ("matmul", "attention", "other kernels", "optimizer", "communication"):
        summary[f"{kind} ms"] = _length(_union(by_kind.get(kind, []))) / 1e3 / n
    summary["exposed communication ms"] = (_length(comm) - _overlap(comm, compute)) / 1e3 / n
    summary["idle GPU ms"] = (window[1] - window[0] - _length(busy)) / 1e3 / n
    heaviest = sorted(by_name.items(), key=lambda item: -item[1])[:TOP_KERNELS]
    summary["top kernels"] = [(name, total / 1e3 / n) for name, total in heaviest]
    return summary


TOP_KERNELS = 12


def _short_name(kernel: str) -> str:
    """A kernel's name without template arguments and parameter lists, so that one kernel's
    launches with different shapes add up under one name (``void at::native::foo<...>(...)`` ->
    ``at::native::foo``)."""
    name, depth, out = kernel.removeprefix("void "), 0, []
    for ch in name:
        if ch in "<(":
            depth += 1
        elif ch in ">)":
            depth -= 1
        elif depth == 0:
            out.append(ch)
    short = "".join(out).strip()[:80] or kernel[:80]
    if "elementwise_kernel" in short:  # PyTorch's generic kernels: what they compute is in the functor
        functor = _FUNCTOR.search(kernel)
        short += f" [{functor.group(1)}]" if functor else ""
    return short


_FUNCTOR = re.compile(r"([A-Za-z_]\w*(?:Functor\w*|_kernel_cuda|_kernel_impl))")


def format_summary(summary: dict) -> str:
    step = summary["step ms"]
    lines = [f"  {'per step':28s} {step:9.2f} ms"]
    for key, value in summary.items():
        if key.endswith(" ms") and key != "step ms":
            lines.append(f"  {key[:-3]:28s} {value:9.2f} ms  {100 * value / step:5.1f}%")
    lines.append("  (kinds overlap: communication can run beside compute; idle = no kernel at all)")
    if summary.get("top kernels"):
        lines.append("  heaviest kernels per step:")
        lines += [f"    {value:9.2f} ms  {100 * value / step:5.1f}%  {name}" for name, value in summary["top kernels"]]
    for way, sites in summary.get("idle sites", {}).items():
        lines.append(f"  idle GPU by where the host was when the queue {way} (outermost annotation > innermost op):")
        lines += [f"    {ms:9.2f} ms  {100 * ms / step:5.1f}%  {gaps:5d} gaps, longest {longest:6.2f} ms  {where}"
                  for ms, gaps, longest, where in sites]
    return "\n".join(lines)
