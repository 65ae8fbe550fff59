"""The GPU suite's shards and their records (tests/gpu_shards.py, rendered by benchmarks/render.py)."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from benchmarks.render import gpu_tests_markdown
from gpu_shards import ShardPlugin, assign, measured_durations, parse_shard

NODES = [f"tests/test_{f}.py::t{i}" for f in "abcd" for i in range(3)] + ["tests/test_big.py::slow", "tests/test_big.py::fast"]


def test_every_test_lands_in_exactly_one_shard_and_the_cut_is_the_same_every_time():
    shards = assign(NODES, 3, {})
    assert sorted(n for shard in shards for n in shard) == sorted(NODES)
    again = assign(list(reversed(NODES)), 3, {})  # another machine may collect in another order
    assert [sorted(s) for s in again] == [sorted(s) for s in shards]


def test_a_file_stays_in_one_shard_unless_it_alone_outweighs_a_shards_share():
    whole = assign(NODES, 2, {})
    for f in "abcd":
        assert sum(any(n.startswith(f"tests/test_{f}.py") for n in shard) for shard in whole) == 1
    heavy = assign(NODES, 2, {"tests/test_big.py::slow": 500, "tests/test_big.py::fast": 400})
    holders = [i for i, shard in enumerate(heavy) for n in shard if n.startswith("tests/test_big.py")]
    assert sorted(holders) == [0, 1], "the two heavy tests of one file go to different shards"


def test_shards_are_packed_by_measured_duration():
    durations = {n: 1.0 for n in NODES} | {"tests/test_a.py::t0": 100.0}
    heavy, light = sorted(assign(NODES, 2, durations), key=len)
    assert heavy == ["tests/test_a.py::t0"] and len(light) == len(NODES) - 1, "the 100 s test alone, the 13 others beside it"


def test_the_newest_record_of_a_test_gives_its_duration():
    records = [{"case": "gpu-tests", "time": "2026-11-27T10:00:00", "durations": {"x": 9.0, "y": 1.0}},
               {"case": "gpu-tests", "time": "2026-11-27T11:00:00", "durations": {"x": 3.0}},
               {"case": "ref-dp4", "time": "2026-11-27T12:00:00", "durations": {"x": 99.0}}]
    assert measured_durations(records) == {"x": 3.0, "y": 1.0}


@pytest.mark.parametrize("text", ["3", "0/4", "5/4", "a/b"])
def test_a_bad_shard_is_one_sentence(text):
    with pytest.raises(ValueError, match="--shard"):
        parse_shard(text)


def _report(node, when, outcome, longrepr=None, duration=1.0):
    return SimpleNamespace(nodeid=node, when=when, duration=duration, skipped=outcome == "skipped", failed=outcome == "failed",
                           passed=outcome == "passed", longrepr=longrepr, longreprtext=str(longrepr or ""))


def test_the_record_counts_outcomes_keeps_skip_reasons_and_says_when_a_run_stopped_early(tmp_path):
    plugin = ShardPlugin((2, 3), str(tmp_path), ["-m", "gpu", "--shard=2/3"])
    for node, outcome, longrepr in [("t::ok", "passed", None), ("t::two", "skipped", ("t.py", 3, "Skipped: needs 2 CUDA GPUs")),
                                    ("t::bad", "failed", "assert 1 == 2")]:
        plugin.pytest_runtest_logreport(_report(node, "setup" if outcome == "skipped" else "call", outcome, longrepr))
        plugin.pytest_runtest_logreport(_report(node, "teardown", "passed"))
    stopped = json.loads((tmp_path / "records.jsonl").read_text())
    assert stopped["figures"] == {"passed": 1, "failed": 1, "error": 0, "skipped": 1, "xfailed": 0, "finished": False}
    assert stopped["status"] == "failed" and "stopped before" in stopped["error"]
    plugin.pytest_sessionfinish(None, 1)
    [record] = [json.loads(line) for line in (tmp_path / "records.jsonl").read_text().splitlines()]  # rewritten, not appended
    assert (record["case"], record["shard"], record["figures"]["finished"]) == ("gpu-tests", "2/3", True)
    assert record["skips"] == [{"test": "t::two", "reason": "needs 2 CUDA GPUs"}]
    assert record["failures"][0]["test"] == "t::bad" and record["durations"]["t::ok"] == 2.0


def test_results_show_the_newest_record_of_each_shard():
    old = {"case": "gpu-tests", "shard": "1/2", "date": "2026-11-26", "time": "2026-11-26T10:00:00", "commit": "aaa",
           "figures": {"passed": 1, "failed": 1, "finished": True}, "failures": [{"test": "t::x", "error": "call: boom"}]}
    new = {**old, "date": "2026-11-27", "time": "2026-11-27T10:00:00", "commit": "bbb", "figures": {"passed": 2, "failed": 0,
           "finished": True}, "failures": [], "skips": [{"test": "t::y", "reason": "needs 4 CUDA GPUs (NCCL)"}]}
    other = {**old, "shard": "2/2", "commit": "ccc"}
    text = "\n".join(gpu_tests_markdown([old, new, other]))
    assert "| 1/2 | 2026-11-27 |" in text and "| bbb |" in text and "| aaa |" not in text
    assert "| 2/2 |" in text and "t::x" in text and "1 x needs 4 CUDA GPUs (NCCL)" in text
