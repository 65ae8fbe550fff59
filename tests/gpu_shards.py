"""The GPU suite in shards, and a record of each shard's run.

``pytest -m gpu --shard K/N`` keeps the K-th of N shards. Shards are packed by expected time, longest first
(each to the lightest shard so far), from the durations the newest ``gpu-tests`` records measured
(benchmarks/records/); a test none measured counts ``UNMEASURED_S``. A test file goes to one shard whole, so its
module fixtures (a JIT-built op, a loaded model) are paid once, unless it alone is heavier than a shard's fair share,
when its tests are packed one by one. The assignment depends only on the collected node ids and the stored records,
so every machine that runs the same checkout cuts the same shards; a machine with fewer GPUs runs its shard and
the tests that need more skip with their reason.

``--gpu-record DIR`` appends one record per run to ``DIR/records.jsonl`` (case ``gpu-tests``, suite ``tests``): the
shard, the counts, every skip's reason, the failures, each test's duration, the device and the commit. It is
rewritten after every test, so a run killed at its time limit still says how far it came.
``python -m benchmarks render --add DIR/records.jsonl`` files it; RESULTS.md shows the newest record of each shard.
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
    """Each test's duration from the newest gpu-tests record that ran it (records in filing order)."""
    newest = sorted((r for r in records if r.get("case") == "gpu-tests"), key=lambda r: (r.get("time", ""), r.get("_order", 0)))
    durations: dict[str, float] = {}
    for record in newest:
        durations.update(record.get("durations", {}))
    return durations


def assign(node_ids: list[str], n: int, durations: dict[str, float]) -> list[list[str]]:
    """The node ids cut into ``n`` shards of about equal expected time (see the module's docstring)."""
    weight = {node: durations.get(node, UNMEASURED_S) for node in node_ids}
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


def _whole_suite(argv: list[str]) -> bool:
    """No file, node or -k named: the run is the whole GPU suite or a whole shard of it (else its record says "part")."""
    valued = {"-m", "-k", "-p", "-c", "--deselect", "--durations", "-n", "--maxfail"}
    return not any(a == "-k" or a.startswith("--deselect") or (not a.startswith("-") and (i == 0 or argv[i - 1] not in valued))
                   for i, a in enumerate(argv))


def _skip_reason(report) -> str:
    longrepr = report.longrepr
    reason = longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)
    return reason.removeprefix("Skipped: ")


class ShardPlugin:
    """Keeps one shard's tests (``--shard``) and records the run (``--gpu-record``)."""

    def __init__(self, shard: Optional[tuple[int, int]], record_dir: Optional[str], argv: list[str]):
        self.shard = shard
        self.record_dir = record_dir
        self.started = time.monotonic()
        self.outcomes: dict[str, str] = {}
        self.skips: dict[str, str] = {}
        self.failures: dict[str, str] = {}
        self.durations: dict[str, float] = {}
        self.record: dict = {}
        if record_dir:
            from benchmarks.runner import current_commit, device_label_of, gpu_names
            now = datetime.datetime.now()
            self.record = {"call": f"{now.strftime('%Y-%m-%dT%H%M%S')}-{socket.gethostname().split('.')[0]}",
                           "suite": "tests", "case": "gpu-tests", "system": "hybridlm",
                           "shard": "part" if not _whole_suite(argv) else f"{shard[0]}/{shard[1]}" if shard else "all",
                           "device": device_label_of(len(gpu_names())),
                           "commit": current_commit(), "command": " ".join(["pytest", *argv]),
                           "date": now.date().isoformat(), "time": now.isoformat(timespec="seconds")}

    @pytest.hookimpl(trylast=True)  # after -m and -k have deselected: shards cut what is left
    def pytest_collection_modifyitems(self, session, config, items):
        if not self.shard:
            return
        from benchmarks.records import load_all
        k, n = self.shard
        keep = set(assign([item.nodeid for item in items], n, measured_durations(load_all()))[k - 1])
        config.hook.pytest_deselected(items=[item for item in items if item.nodeid not in keep])
        items[:] = [item for item in items if item.nodeid in keep]

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
        if report.when == "teardown":
            self._write(finished=False)

    def pytest_sessionfinish(self, session, exitstatus):
        self._write(finished=True)

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
                  "durations": self.durations}
        if not finished:
            record["error"] = "stopped before the shard's last test (killed at its time limit?)"
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


def configure(config) -> None:
    """Register the plugin when ``--shard`` or ``--gpu-record`` is given (conftest.py calls this)."""
    shard_text, record_dir = config.getoption("shard"), config.getoption("gpu_record")
    if not shard_text and not record_dir:
        return
    try:
        shard = parse_shard(shard_text) if shard_text else None
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    config.pluginmanager.register(ShardPlugin(shard, record_dir, sys.argv[1:]), "gpu_shards")
