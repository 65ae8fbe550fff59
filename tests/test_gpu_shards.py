"""The GPU suite's shards and their records (tests/gpu_shards.py, rendered by benchmarks/render.py)."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from benchmarks.render import gpu_tests_markdown
from gpu_shards import (CALL_ENV, LANES_ENV, PASSES, PLAN_ENV, ShardPlugin, assign, expected_durations, finish_record, lanes_of,
                        measured_durations, parse_shard, pin_lane, read_plan, skipped_durations)

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


def test_a_test_weighs_its_duration_times_the_share_of_the_machine_it_holds():
    # on four GPUs four one-GPU tests run side by side, or two two-GPU tests, while a four-GPU test runs alone
    durations = {n: 4.0 for n in NODES} | {"tests/test_a.py::t0": 14.0}
    alone = assign(NODES, 2, durations, {"tests/test_a.py::t0": 4})
    assert ["tests/test_a.py::t0"] in alone, f"14 s holding the machine against 13 tests of 4 s in four lanes: {alone}"
    laned = assign(NODES, 2, durations)
    assert ["tests/test_a.py::t0"] not in laned, "as a one-GPU test it counts 3.5 s and keeps its file's company"


def test_the_newest_record_of_a_test_gives_its_duration():
    records = [{"case": "gpu-tests", "time": "2026-11-27T10:00:00", "durations": {"x": 9.0, "y": 1.0}},
               {"case": "gpu-tests", "time": "2026-11-27T11:00:00", "durations": {"x": 3.0}},
               {"case": "ref-dp4", "time": "2026-11-27T12:00:00", "durations": {"x": 99.0}}]
    assert measured_durations(records) == {"x": 3.0, "y": 1.0}


def test_a_record_that_skipped_a_test_does_not_measure_it():
    records = [{"case": "gpu-tests", "time": "2026-11-27T10:00:00", "durations": {"x": 240.0, "y": 5.0},
                "outcomes": {"x": "passed", "y": "passed"}},
               # a machine of two GPUs: the four-GPU test x skipped at once
               {"case": "gpu-tests", "time": "2026-11-27T11:00:00", "durations": {"x": 0.01, "y": 4.0},
                "outcomes": {"x": "skipped", "y": "passed"}},
               # an older record, without outcomes: a duration of 0 was a skip
               {"case": "gpu-tests", "time": "2026-11-27T12:00:00", "durations": {"x": 0.0}}]
    assert measured_durations(records) == {"x": 240.0, "y": 4.0}
    # a test no record ran (a backend missing on every machine so far) keeps what its skip took
    only_skipped = records + [{"case": "gpu-tests", "time": "2026-11-27T13:00:00", "durations": {"z": 0.02},
                               "outcomes": {"z": "skipped"}}]
    assert skipped_durations(only_skipped) == {"z": 0.02}


def test_a_tests_own_estimate_stands_until_a_record_runs_it():
    marked = lambda node, s: SimpleNamespace(nodeid=node, get_closest_marker=lambda name: SimpleNamespace(args=(s,)) if name == "gpu_seconds" else None)
    records = [{"case": "gpu-tests", "time": "2026-11-27T10:00:00", "durations": {"x": 0.01, "y": 30.0},
                "outcomes": {"x": "skipped", "y": "passed"}}]
    assert expected_durations(records, [marked("x", 260), marked("y", 260)]) == {"x": 260.0, "y": 30.0}


@pytest.mark.parametrize("text", ["3", "0/4", "5/4", "a/b"])
def test_a_bad_shard_is_one_sentence(text):
    with pytest.raises(ValueError, match="--shard"):
        parse_shard(text)


def _report(node, when, outcome, longrepr=None, duration=1.0, properties=()):
    return SimpleNamespace(nodeid=node, when=when, duration=duration, skipped=outcome == "skipped", failed=outcome == "failed",
                           passed=outcome == "passed", longrepr=longrepr, longreprtext=str(longrepr or ""),
                           user_properties=list(properties))


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


def test_a_module_skipped_at_collection_is_one_skip_with_its_reason_in_the_first_shards_record_only(tmp_path, monkeypatch):
    # tests/test_qlora.py without bitsandbytes: pytest.importorskip skips the module, so no test of it ever reports
    monkeypatch.setenv(CALL_ENV, "2026-12-01T100000-box")
    skipped = _report("tests/test_qlora.py", "collect", "skipped", ("tests/test_qlora.py", 12, "Skipped: QLoRA's base is bitsandbytes'"))
    records = {}
    for k in (1, 2):
        plugin = ShardPlugin((k, 2), str(tmp_path / str(k)), [f"--shard={k}/2"])
        plugin.pytest_collectreport(_report("tests/test_ops.py", "collect", "passed"))
        plugin.pytest_collectreport(skipped)
        plugin.pytest_runtest_logreport(_report("t::ok", "call", "passed"))
        plugin.pytest_sessionfinish(None, 0)
        records[k] = json.loads((tmp_path / str(k) / "records.jsonl").read_text())
    assert records[1]["skips"] == [{"test": "tests/test_qlora.py", "reason": "QLoRA's base is bitsandbytes'"}]
    assert records[1]["figures"]["skipped"] == 1 and records[1]["figures"]["passed"] == 1
    assert records[2]["skips"] == [] and records[2]["figures"]["skipped"] == 0


def test_what_a_test_says_of_itself_reaches_the_record_and_survives_the_next_pass(tmp_path, monkeypatch):
    # a slow test's breakdown (pytest's record_property): where its minutes went, readable without another GPU run
    monkeypatch.setenv(CALL_ENV, "2026-11-28T030000-box")
    jobs = {"probe EP4 from 3": {"seconds": 41.5, "setup": "set-up 20.1 s: imports 9.0, checkpoint 6.2 (seconds)"}}
    first = ShardPlugin((1, 2), str(tmp_path), ["--shard=1/2", "--gpu-pass=lanes1"], "lanes1")
    first.pytest_runtest_logreport(_report("t::slow", "call", "passed", properties=[("jobs", jobs)]))
    first.pytest_runtest_logreport(_report("t::quiet", "call", "passed"))
    first.pytest_sessionfinish(None, 0)
    ShardPlugin((1, 2), str(tmp_path), ["--shard=1/2", "--gpu-pass=whole"], "whole").pytest_sessionfinish(None, 0)
    finish_record(str(tmp_path), "2026-11-28T030000-box")
    [record] = [json.loads(line) for line in (tmp_path / "records.jsonl").read_text().splitlines()]
    assert record["properties"] == {"t::slow": {"jobs": jobs}}


def test_results_show_the_newest_record_of_each_shard():
    old = {"case": "gpu-tests", "shard": "1/2", "date": "2026-11-26", "time": "2026-11-26T10:00:00", "commit": "aaa",
           "figures": {"passed": 1, "failed": 1, "finished": True}, "failures": [{"test": "t::x", "error": "call: boom"}]}
    new = {**old, "date": "2026-11-27", "time": "2026-11-27T10:00:00", "commit": "bbb", "figures": {"passed": 2, "failed": 0,
           "finished": True}, "failures": [], "skips": [{"test": "t::y", "reason": "needs 4 CUDA GPUs (NCCL)"}]}
    other = {**old, "shard": "2/2", "commit": "ccc"}
    text = "\n".join(gpu_tests_markdown([old, new, other]))
    assert "| 1/2 | 2026-11-27 |" in text and "| bbb |" in text and "| aaa |" not in text
    assert "| 2/2 |" in text and "t::x" in text and "1 x needs 4 CUDA GPUs (NCCL)" in text


def test_results_say_when_every_shard_of_one_cut_last_passed_and_leave_older_cuts_out_of_the_table():
    def shard(k, n, commit, time, failed=0, finished=True):
        return {"case": "gpu-tests", "shard": f"{k}/{n}", "date": time[:10], "time": time, "commit": commit,
                "device": "4x H200", "figures": {"passed": 3, "failed": failed, "finished": finished}, "failures": []}
    two_cut = [shard(1, 2, "aaa", "2026-11-27T10:00:00", failed=3), shard(2, 2, "aaa", "2026-11-27T11:00:00")]
    three_of_four = [shard(k, 4, "bbb", f"2026-11-28T0{k}:00:00") for k in (1, 2, 4)]
    text = "\n".join(gpu_tests_markdown(two_cut + three_of_four))
    assert "has not yet passed" in text and "| 1/2 |" not in text and "1/2, 2/2" in text
    assert "| 4/4 |" in text and "| 3/4 |" not in text
    unfinished = "\n".join(gpu_tests_markdown(two_cut + three_of_four + [shard(3, 4, "bbb", "2026-11-28T05:00:00", finished=False)]))
    assert "has not yet passed" in unfinished
    whole = "\n".join(gpu_tests_markdown(two_cut + three_of_four + [shard(3, 4, "bbb", "2026-11-28T05:00:00")]))
    assert "last passed on 2026-11-28 at bbb on 4x H200: all 4 shards" in whole


def test_gpus_are_cut_into_lanes_of_a_width_and_too_few_make_one_lane_of_all():
    assert lanes_of(["0", "1", "2", "3"], 2) == [["0", "1"], ["2", "3"]]
    assert lanes_of(["0", "1", "2", "3"], 1) == [["0"], ["1"], ["2"], ["3"]]
    assert lanes_of(["4", "5", "6", "7", "0", "1"], 2) == [["4", "5"], ["6", "7"], ["0", "1"]]
    assert lanes_of(["0", "1", "2"], 2) == [["0", "1", "2"]] and lanes_of(["3"], 1) == [["3"]]


def test_each_xdist_worker_of_a_laned_run_sees_its_own_lane_and_other_runs_are_left_alone():
    env = {LANES_ENV: "0,1;2,3", "PYTEST_XDIST_WORKER": "gw1"}
    assert pin_lane(env) == "2,3" and env["CUDA_VISIBLE_DEVICES"] == "2,3"
    for untouched in ({"PYTEST_XDIST_WORKER": "gw1"}, {LANES_ENV: "0,1;2,3"}, {LANES_ENV: "0,1;2,3", "PYTEST_XDIST_WORKER": "master"}):
        assert pin_lane(untouched) is None and "CUDA_VISIBLE_DEVICES" not in untouched


@pytest.mark.parametrize("visible, gpus, only, flags", [
    (None, 2, None, ["--num_gpus", "2"]),  # the whole machine: DeepSpeed's own numbering
    (None, 1, 3, ["--include", "localhost:3"]),
    ("2,3", 2, None, ["--include", "localhost:2,3"]),  # a lane: its GPUs by name, not GPUs 0 and 1
    ("2,3", 1, None, ["--include", "localhost:2"]),
    ("2,3", 1, 1, ["--include", "localhost:3"])])
def test_the_deepspeed_launcher_is_told_the_gpus_this_process_was_given(monkeypatch, visible, gpus, only, flags):
    from benchmarks.runner import gpu_choice
    monkeypatch.delenv("DS_ACCELERATOR", raising=False)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    if visible:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    assert gpu_choice(gpus, only) == flags


def test_a_lane_cannot_start_a_job_of_more_gpus_than_it_holds(monkeypatch):
    from benchmarks.runner import gpu_choice
    monkeypatch.delenv("DS_ACCELERATOR", raising=False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    with pytest.raises(SystemExit, match="4 GPUs wanted, CUDA_VISIBLE_DEVICES=2,3 gives 2"):
        gpu_choice(4)


def _item(node, gpus=None):
    mark = SimpleNamespace(args=(gpus,)) if gpus else None
    return SimpleNamespace(nodeid=node, get_closest_marker=lambda name: mark if name == "gpus" else None)


@pytest.mark.parametrize("shard", [(1, 2), (2, 2)])
def test_the_passes_of_a_shard_split_it_by_the_gpus_each_test_needs(shard):
    items = [_item(n) for n in NODES] + [_item("tests/test_e.py::two", 2), _item("tests/test_e.py::four", 4)]
    config = SimpleNamespace(hook=SimpleNamespace(pytest_deselected=lambda items: None))
    whole_shard = list(items)
    ShardPlugin(shard, None, []).pytest_collection_modifyitems(None, config, whole_shard)
    kept = {}
    for gpu_pass in PASSES:
        mine = list(items)
        ShardPlugin(shard, None, [], gpu_pass).pytest_collection_modifyitems(None, config, mine)
        kept[gpu_pass] = {i.nodeid for i in mine}
    assert set().union(*kept.values()) == {i.nodeid for i in whole_shard}
    assert sum(len(k) for k in kept.values()) == len(whole_shard), "each test in one pass"
    assert kept["lanes2"] <= {"tests/test_e.py::two"} and kept["whole"] <= {"tests/test_e.py::four"}


def test_the_second_pass_adds_to_the_first_passs_record_of_the_shard(tmp_path, monkeypatch):
    monkeypatch.setenv(CALL_ENV, "2026-11-27T180000-box")
    first = ShardPlugin((1, 2), str(tmp_path), ["-m", "gpu", "--shard=1/2", "--gpu-pass=lanes1", "-n", "4"], "lanes1")
    first.pytest_runtest_logreport(_report("t::one", "call", "passed"))
    first.pytest_runtest_logreport(_report("t::two", "call", "failed", "assert 0"))
    first.pytest_sessionfinish(None, 1)
    [after_lanes] = [json.loads(line) for line in (tmp_path / "records.jsonl").read_text().splitlines()]
    assert after_lanes["figures"]["finished"] is False, "a shard whose whole pass was killed once claimed to be finished"
    assert "not every pass" in after_lanes["error"]
    second = ShardPlugin((1, 2), str(tmp_path), ["-m", "gpu", "--shard=1/2", "--gpu-pass=whole"], "whole")
    second.pytest_runtest_logreport(_report("t::four", "setup", "skipped", ("t.py", 9, "Skipped: needs 4 CUDA GPUs (NCCL)")))
    second.pytest_sessionfinish(None, 0)
    [unfinished] = [json.loads(line) for line in (tmp_path / "records.jsonl").read_text().splitlines()]
    assert unfinished["figures"]["finished"] is False, "only the suite, having run every pass, says the shard finished"
    finish_record(str(tmp_path), "2026-11-27T180000-box")
    [record] = [json.loads(line) for line in (tmp_path / "records.jsonl").read_text().splitlines()]
    assert (record["call"], record["shard"]) == ("2026-11-27T180000-box", "1/2") and "error" not in record
    assert record["figures"] == {"passed": 1, "failed": 1, "error": 0, "skipped": 1, "xfailed": 0, "finished": True}
    assert record["status"] == "failed" and record["failures"][0]["test"] == "t::two"
    assert set(record["durations"]) == {"t::one", "t::two", "t::four"} and "&&" in record["command"]


def test_make_test_gpu_runs_four_one_gpu_lanes_then_two_two_gpu_lanes_on_four_gpus():
    from gpu_suite import passes
    (one, one_env), (two, two_env), (whole, whole_env) = passes("2/4", "/out", ["0", "1", "2", "3"], None, [])
    assert one[one.index("-n") + 1] == "4" and "--gpu-pass=lanes1" in one and one_env[LANES_ENV] == "0;1;2;3"
    assert two[two.index("-n") + 1] == "2" and "--gpu-pass=lanes2" in two and two_env[LANES_ENV] == "0,1;2,3"
    assert "--gpu-pass=whole" in whole and "-n" not in whole and LANES_ENV not in whole_env
    assert {"--shard=2/4", "--gpu-record=/out"} <= set(one) & set(two) & set(whole)
    assert one_env[CALL_ENV] == two_env[CALL_ENV] == whole_env[CALL_ENV], "one record for the shard"


def test_two_gpus_make_two_one_gpu_lanes_and_one_pytest_for_the_two_gpu_tests():
    from gpu_suite import passes
    (one, one_env), (two, two_env), _ = passes("1/4", None, ["0", "1"], None, [])
    assert one[one.index("-n") + 1] == "2" and one_env[LANES_ENV] == "0;1"
    assert "-n" not in two and LANES_ENV not in two_env
    for laned, env in passes("1/4", None, ["0", "1", "2", "3"], 1, [])[:2]:  # LANES=1: one test at a time
        assert "-n" not in laned and LANES_ENV not in env


def test_the_first_pass_tells_the_suite_how_many_tests_each_pass_has(tmp_path, monkeypatch):
    plan = tmp_path / "plan.json"
    monkeypatch.setenv(PLAN_ENV, str(plan))
    items = [_item(n) for n in NODES] + [_item("tests/test_e.py::two", 2)]
    config = SimpleNamespace(hook=SimpleNamespace(pytest_deselected=lambda items: None))
    kept = list(items)
    ShardPlugin((1, 1), None, [], "lanes1").pytest_collection_modifyitems(None, config, kept)
    assert read_plan(str(plan)) == {"lanes1": len(NODES), "lanes2": 1, "whole": 0} and len(kept) == len(NODES)


@pytest.mark.parametrize("exits, finished", [((0, 1, 0), True), ((0, 2, 0), False)], ids=["failures", "interrupted"])
def test_the_suite_skips_passes_with_no_tests_and_finishes_the_record_only_when_every_pass_ran(tmp_path, monkeypatch, exits, finished):
    # Each pytest start costs 15-25 s on the GPU machine, so a pass the first one counted empty is not started; and
    # a record is finished only when no pass was cut short (exit 2-4: interrupted, internal or usage error).
    import gpu_suite
    started, codes = [], iter(exits)

    def fake_pytest(command, env, cwd):  # the passes' pytest, which here only writes what a real first pass writes
        gpu_pass = next(a.split("=", 1)[1] for a in command if a.startswith("--gpu-pass="))
        started.append(gpu_pass)
        if gpu_pass == "lanes1":
            with open(env[PLAN_ENV], "w") as f:
                json.dump({"lanes1": 5, "lanes2": 2, "whole": 0}, f)
        # the pass's environment, as a real pass runs in it: its call names the one record (without it, each pass
        # named its own from the clock's second, and two passes a second apart wrote two records)
        monkeypatch.setenv(CALL_ENV, env[CALL_ENV])
        plugin = ShardPlugin((1, 4), str(tmp_path), ["--shard=1/4"], gpu_pass)
        plugin.pytest_runtest_logreport(_report(f"t::{gpu_pass}", "call", "passed"))
        plugin.pytest_sessionfinish(None, 0)
        return next(codes)

    monkeypatch.setattr(gpu_suite.subprocess, "call", fake_pytest)
    monkeypatch.setattr(gpu_suite, "visible_gpus", lambda: ["0", "1", "2", "3"])
    monkeypatch.setattr("sys.argv", ["gpu_suite.py", "--shard", "1/4", "--record", str(tmp_path)])
    code = gpu_suite.main()
    assert started == ["lanes1", "lanes2"], "the whole pass had none of the shard's tests"
    [record] = [json.loads(line) for line in (tmp_path / "records.jsonl").read_text().splitlines()]
    assert record["figures"]["finished"] is finished and code == max(exits)
