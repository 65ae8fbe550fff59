"""The GPU suite in shards, and a record of each shard's run.

``pytest -m gpu --shard K/N`` keeps the K-th of N shards. Shards are packed by expected time, longest first
(each to the lightest shard so far), from the durations the newest ``gpu-tests`` records measured
(benchmarks/records/); a test none ran counts its ``gpu_seconds`` mark, else what a skip of it took, else
``UNMEASURED_S`` (``expected_durations``). A test file goes to one shard whole, so its module fixtures (a JIT-built
op, a loaded model) are paid once, unless it alone is heavier than a shard's fair share, when its tests are packed
one by one. The assignment depends only on the collected node ids and the stored records, so every machine that
runs the same checkout cuts the same shards; a machine with fewer GPUs runs its shard and the tests that need more
skip with their reason.

``--gpu-record DIR`` appends one record per run to ``DIR/records.jsonl`` (case ``gpu-tests``, suite ``tests``): the
shard, the counts, every skip's reason, the failures, each test's duration, what a test said of itself through
pytest's ``record_property`` (a slow test's breakdown, say), the device and the commit. It is
rewritten after every test, so a run killed at its time limit still says how far it came.
``python -m benchmarks render --add DIR/records.jsonl`` files it; RESULTS.md shows the newest record of each shard.

Lanes (``make test-gpu``, tests/gpu_suite.py): most GPU tests need one GPU, some two (``@pytest.mark.gpus(2)``), and
each spends most of its time starting processes, so a shard runs in three passes. ``--gpu-pass lanes1`` keeps the
shard's one-GPU tests and runs them on pytest-xdist workers that each see their own GPU (four at once on four GPUs);
``--gpu-pass lanes2`` its two-GPU tests, on workers that each see a lane of two; ``--gpu-pass whole`` the tests
marked for more, on every GPU. A worker is pinned to its lane by ``pin_lane`` (CUDA_VISIBLE_DEVICES set before torch
is imported; the project's launchers name those GPUs instead of counting from 0). The passes write one record: the
same call (``HYBRIDLM_GPU_CALL``), each adding to what the ones before recorded.
"""
from __future__ import annotations

import datetime
import json
import os
import socket
import sys
import time
from typing import Optional

import pytest

UNMEASURED_S = 20.0  # most GPU tests launch processes and build or load a model
LANE_WIDTHS = (1, 2)  # the lanes' sizes, one pass each: a test needing n GPUs runs in a lane of n (more: the whole pass)
CUT_FOR_GPUS = 4  # the machine the shards are cut for (the cut is the same on every machine)
PASSES = tuple(f"lanes{width}" for width in LANE_WIDTHS) + ("whole",)
LANES_ENV = "HYBRIDLM_GPU_LANES"  # the lanes of a run, e.g. "0,1;2,3": an xdist worker gwK takes the K-th
CALL_ENV = "HYBRIDLM_GPU_CALL"  # one record for the passes of one shard
PLAN_ENV = "HYBRIDLM_GPU_PLAN"  # a file for the shard's count of tests in each pass, so empty passes are not started


def lanes_of(visible: list[str], width: int) -> list[list[str]]:
    """The GPUs cut into lanes of ``width`` (a remainder joins no lane); one lane of all when two do not fit."""
    if len(visible) < 2 * width:
        return [visible]
    return [visible[i:i + width] for i in range(0, len(visible) - width + 1, width)]


def pin_lane(env=os.environ) -> Optional[str]:
    """In a pytest-xdist worker of a laned run, show this worker only its lane's GPUs; the lane, or None. Called
    before torch is imported (tests/conftest.py): CUDA reads CUDA_VISIBLE_DEVICES once, when first asked."""
    lanes, worker = env.get(LANES_ENV), env.get("PYTEST_XDIST_WORKER", "")
    if not lanes or not worker.startswith("gw"):
        return None
    lane = lanes.split(";")[int(worker[2:]) % len(lanes.split(";"))]
    env["CUDA_VISIBLE_DEVICES"] = lane
    return lane


def gpus_needed(item) -> int:
    """``@pytest.mark.gpus(n)``: the GPUs a test needs at once (1 unmarked)."""
    mark = item.get_closest_marker("gpus")
    return int(mark.args[0]) if mark else 1


def parse_shard(text: str) -> tuple[int, int]:
    """``"2/4"`` -> (2, 4); ValueError with one sentence otherwise."""
    try:
        k, n = (int(part) for part in text.split("/"))
    except ValueError:
        raise ValueError(f"--shard {text!r}: expected K/N, e.g. 1/4") from None
    if not 1 <= k <= n:
        raise ValueError(f"--shard {text}: K must be between 1 and N")
    return k, n


def measured_durations(records: list[dict]) -> dict[str, float]:
    """Each test's duration from the newest gpu-tests record that ran it (records in filing order). A record that
    skipped a test did not measure it: a four-GPU test skipped on two GPUs once counted 0 s, and the shard that drew it
    ran past its time limit. (Records from before outcomes were kept say a skip only by a duration of 0.)"""
    return _durations(records, skipped=False)


def skipped_durations(records: list[dict]) -> dict[str, float]:
    """The tests records only ever skipped (a backend missing there, too few GPUs), with the newest skip's duration."""
    ran = measured_durations(records)
    return {node: seconds for node, seconds in _durations(records, skipped=True).items() if node not in ran}


def _durations(records: list[dict], skipped: bool) -> dict[str, float]:
    newest = sorted((r for r in records if r.get("case") == "gpu-tests"), key=lambda r: (r.get("time", ""), r.get("_order", 0)))
    durations: dict[str, float] = {}
    for record in newest:
        outcomes = record.get("outcomes")
        for node, seconds in record.get("durations", {}).items():
            was_skipped = outcomes.get(node) == "skipped" if outcomes is not None else seconds == 0
            if was_skipped == skipped:
                durations[node] = seconds
    return durations


def expected_durations(records: list[dict], items) -> dict[str, float]:
    """What the cut counts for each test: a run's measure first, then the test's own ``@pytest.mark.gpu_seconds(s)``
    (for a slow test no record has run yet, which would otherwise count ``UNMEASURED_S``), then a skip's (about 0 s)."""
    estimates = {item.nodeid: float(mark.args[0]) for item in items if (mark := item.get_closest_marker("gpu_seconds"))}
    return {**skipped_durations(records), **estimates, **measured_durations(records)}


def assign(node_ids: list[str], n: int, durations: dict[str, float], needs: Optional[dict[str, int]] = None) -> list[list[str]]:
    """The node ids cut into ``n`` shards of about equal expected time on ``CUT_FOR_GPUS`` GPUs (see the module's
    docstring): a test that ``needs`` k GPUs (1 unless said) shares the machine with the lanes beside it, so it counts
    k / ``CUT_FOR_GPUS`` of its measured time; a four-GPU test holds the machine alone and counts all of it."""
    needs = needs or {}
    weight = {node: durations.get(node, UNMEASURED_S) * min(needs.get(node, 1), CUT_FOR_GPUS) / CUT_FOR_GPUS for node in node_ids}
    by_file: dict[str, list[str]] = {}
    for node in sorted(node_ids):  # the cut depends on the ids, not on the order a machine collected them in
        by_file.setdefault(node.split("::")[0], []).append(node)
    fair = sum(weight.values()) / n
    groups = []
    for nodes in by_file.values():
        cost = sum(weight[node] for node in nodes)
        groups += [[node] for node in nodes] if cost > fair and len(nodes) > 1 else [nodes]
    groups.sort(key=lambda g: (-sum(weight[node] for node in g), g[0]))
    shards: list[list[str]] = [[] for _ in range(n)]
    loads = [0.0] * n
    for group in groups:
        lightest = min(range(n), key=lambda i: (loads[i], i))
        shards[lightest] += group
        loads[lightest] += sum(weight[node] for node in group)
    return shards


def _in_pass(needed: int, gpu_pass: str) -> bool:
    """A test that needs ``needed`` GPUs runs in the lanes of that width, or in the whole pass when no lane is as wide."""
    return needed > max(LANE_WIDTHS) if gpu_pass == "whole" else gpu_pass == f"lanes{needed}"


def _whole_suite(argv: list[str]) -> bool:
    """No file, node or -k named: the run is the whole GPU suite or a whole shard of it (else its record says "part")."""
    valued = {"-m", "-k", "-p", "-c", "--deselect", "--durations", "-n", "--maxfail", "--dist", "--gpu-pass", "--shard", "--gpu-record"}
    return not any(a == "-k" or a.startswith("--deselect") or (not a.startswith("-") and (i == 0 or argv[i - 1] not in valued))
                   for i, a in enumerate(argv))


def _skip_reason(report) -> str:
    longrepr = report.longrepr
    reason = longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)
    return reason.removeprefix("Skipped: ")


class ShardPlugin:
    """Keeps one shard's tests (``--shard``) and records the run (``--gpu-record``)."""

    def __init__(self, shard: Optional[tuple[int, int]], record_dir: Optional[str], argv: list[str], gpu_pass: Optional[str] = None):
        self.shard = shard
        self.gpu_pass = gpu_pass
        self.record_dir = record_dir
        self.started = time.monotonic()
        self.outcomes: dict[str, str] = {}
        self.skips: dict[str, str] = {}
        self.failures: dict[str, str] = {}
        self.durations: dict[str, float] = {}
        self.properties: dict[str, dict] = {}  # what a test said of itself (pytest's record_property), by test
        self.record: dict = {}
        if record_dir:
            from benchmarks.runner import current_commit, device_label_of, gpu_names
            now = datetime.datetime.now()
            call = os.environ.get(CALL_ENV) or f"{now.strftime('%Y-%m-%dT%H%M%S')}-{socket.gethostname().split('.')[0]}"
            self.record = {"call": call,
                           "suite": "tests", "case": "gpu-tests", "system": "hybridlm",
                           "shard": "part" if not _whole_suite(argv) else f"{shard[0]}/{shard[1]}" if shard else "all",
                           "device": device_label_of(len(gpu_names())),
                           "commit": current_commit(), "command": " ".join(["pytest", *argv]),
                           "date": now.date().isoformat(), "time": now.isoformat(timespec="seconds")}
            self._continue(self._recorded(self.record["call"], self.record["shard"]))

    def _recorded(self, call: str, shard: str) -> Optional[dict]:
        """This call's record of the shard, written by an earlier pass of it (``HYBRIDLM_GPU_CALL``), if any."""
        path = os.path.join(self.record_dir, "records.jsonl")
        if not os.path.exists(path):
            return None
        with open(path) as f:
            mine = [r for r in map(json.loads, filter(str.strip, f)) if (r.get("call"), r.get("shard")) == (call, shard)]
        return mine[-1] if mine else None

    def _continue(self, earlier: Optional[dict]) -> None:
        """A later pass adds to the earlier pass's record: its outcomes, skips, failures, durations and time."""
        if not earlier:
            return
        self.started -= earlier.get("wall_s", 0.0)
        self.durations.update(earlier.get("durations", {}))
        self.skips.update({s["test"]: s["reason"] for s in earlier.get("skips", [])})
        self.failures.update({f["test"]: f["error"] for f in earlier.get("failures", [])})
        self.outcomes.update(earlier.get("outcomes", {}))
        self.properties.update(earlier.get("properties", {}))
        self.record.update(command=earlier["command"] + " && " + self.record["command"], date=earlier["date"], time=earlier["time"])

    @pytest.hookimpl(trylast=True)  # after -m and -k have deselected: shards cut what is left
    def pytest_collection_modifyitems(self, session, config, items):
        keep = {item.nodeid for item in items}
        needs = {item.nodeid: gpus_needed(item) for item in items}
        if self.shard:
            from benchmarks.records import load_all
            k, n = self.shard
            keep = set(assign(sorted(keep), n, expected_durations(load_all(), items), needs)[k - 1])
        write_plan(os.environ.get(PLAN_ENV), {p: sum(1 for node in keep if _in_pass(needs[node], p)) for p in PASSES})
        if self.gpu_pass:  # after the shard's cut, so the passes split one shard
            keep = {node for node in keep if _in_pass(needs[node], self.gpu_pass)}
        config.hook.pytest_deselected(items=[item for item in items if item.nodeid not in keep])
        items[:] = [item for item in items if item.nodeid in keep]

    def pytest_collectreport(self, report):
        # A module skipped as a whole (pytest.importorskip of a missing library) yields no test, so no test report: this
        # is the only place its reason shows. Its tests belong to no shard's cut, so the first shard (or an uncut run)
        # keeps it, once, as one skip named by the module. Under xdist the controller gets each such report once.
        if report.skipped and (self.shard is None or self.shard[0] == 1):
            self.outcomes[report.nodeid] = "skipped"
            self.skips[report.nodeid] = _skip_reason(report)

    def pytest_runtest_logreport(self, report):
        node = report.nodeid
        self.durations[node] = round(self.durations.get(node, 0.0) + report.duration, 2)
        if report.skipped and not hasattr(report, "wasxfail"):
            self.outcomes[node] = "skipped"
            self.skips[node] = _skip_reason(report)
        elif report.failed:
            self.outcomes[node] = "failed" if report.when == "call" else "error"
            crash = getattr(report.longrepr, "reprcrash", None)
            self.failures[node] = f"{report.when}: {crash.message if crash else report.longreprtext.strip()[-1500:]}"[:1500]
        elif report.when == "call" and node not in self.outcomes:
            self.outcomes[node] = "xfailed" if hasattr(report, "wasxfail") else "passed"
        if report.when == "call" and report.user_properties:
            self.properties[node] = dict(report.user_properties)
        if report.when == "teardown":
            self._write(finished=False)

    def pytest_sessionfinish(self, session, exitstatus):
        # a pass of a shard leaves the record unfinished: tests/gpu_suite.py finishes it once every pass has run
        self._write(finished=self.gpu_pass is None)

    def _write(self, finished: bool) -> None:
        if not self.record_dir:
            return
        counts = {kind: sum(1 for o in self.outcomes.values() if o == kind)
                  for kind in ("passed", "failed", "error", "skipped", "xfailed")}
        status = "ok" if finished and not counts["failed"] and not counts["error"] else "failed"
        record = {**self.record, "status": status, "wall_s": round(time.monotonic() - self.started, 1),
                  "figures": {**counts, "finished": finished},
                  "skips": [{"test": node, "reason": reason} for node, reason in self.skips.items()],
                  "failures": [{"test": node, "error": error} for node, error in self.failures.items()],
                  "durations": self.durations, "outcomes": self.outcomes, "properties": self.properties}
        if not finished:
            record["error"] = (f"not every pass of the shard ran to its end (the last to write: {self.gpu_pass}; killed at the time limit?)"
                               if self.gpu_pass else "stopped before the shard's last test (killed at its time limit?)")
        os.makedirs(self.record_dir, exist_ok=True)
        path = os.path.join(self.record_dir, "records.jsonl")
        others = []
        if os.path.exists(path):
            with open(path) as f:
                others = [line for line in f if line.strip() and (json.loads(line).get("call"), json.loads(line).get("shard"))
                          != (self.record["call"], self.record["shard"])]
        with open(path + ".tmp", "w") as f:
            f.writelines(others + [json.dumps(record) + "\n"])
        os.replace(path + ".tmp", path)


def write_plan(path: Optional[str], counts: dict[str, int]) -> None:
    """The shard's count of tests per pass, for tests/gpu_suite.py (each xdist worker cuts the same shard and writes
    the same counts; a rename makes each write whole)."""
    if not path:
        return
    with open(f"{path}.{os.getpid()}", "w") as f:
        json.dump(counts, f)
    os.replace(f"{path}.{os.getpid()}", path)


def read_plan(path: str) -> Optional[dict[str, int]]:
    """What ``write_plan`` wrote, or None before the first pass has collected."""
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def finish_record(record_dir: str, call: str) -> Optional[dict]:
    """Mark the call's record finished once every pass of its shard has run (tests/gpu_suite.py): its status from
    its counts, the unfinished pass's note gone. Returns the record, or None if no pass wrote one."""
    path = os.path.join(record_dir, "records.jsonl")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        records = [json.loads(line) for line in f if line.strip()]
    mine = [r for r in records if r.get("call") == call]
    if not mine:
        return None
    record = mine[-1]
    figures = record["figures"]
    record["figures"] = {**figures, "finished": True}
    record["status"] = "ok" if not figures.get("failed") and not figures.get("error") else "failed"
    record.pop("error", None)
    with open(path + ".tmp", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)
    os.replace(path + ".tmp", path)
    return record


def requested(config) -> bool:
    """The run is (a shard of) the GPU suite: ``--shard``, ``--gpu-record`` or ``--gpu-pass`` given."""
    return any(config.getoption(name) for name in ("shard", "gpu_record", "gpu_pass"))


def configure(config) -> None:
    """Register the plugin when the run is the GPU suite's (``requested``; conftest.py calls this)."""
    if not requested(config):
        return
    shard_text, record_dir, gpu_pass = config.getoption("shard"), config.getoption("gpu_record"), config.getoption("gpu_pass")
    if hasattr(config, "workerinput"):  # a pytest-xdist worker: it cuts the shard; the controller gets every report and records
        record_dir = None
    try:
        shard = parse_shard(shard_text) if shard_text else None
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    config.pluginmanager.register(ShardPlugin(shard, record_dir, sys.argv[1:], gpu_pass), "gpu_shards")
