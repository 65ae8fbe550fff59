"""--profile-step-range A,B: a Chrome trace of iterations A+1..B, and one sentence for a bad range."""
from __future__ import annotations

import json

import pytest
import torch

from hybridlm.config import ConfigError
from hybridlm.training.profiling import StepProfiler


def _train(profiler: StepProfiler, iterations: int) -> list[str]:
    """A Linear + SGD loop driven the way the trainer drives it; returns the trace paths written."""
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    written = [profiler.step(0)]
    for iteration in range(1, iterations + 1):
        loss = model(torch.randn(8, 16)).square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        written.append(profiler.step(iteration))
    return [path for path in written if path]


def _events(path) -> list[dict]:
    with open(path) as f:
        return json.load(f)["traceEvents"]


def _profiled_steps(events) -> list[str]:
    return sorted(e["name"] for e in events if e.get("name", "").startswith("ProfilerStep#"))


def test_trace_covers_exactly_the_iterations_after_a_up_to_b(tmp_path):
    profiler = StepProfiler("2,4", str(tmp_path), rank=3)
    written = _train(profiler, iterations=6)

    trace = tmp_path / "trace_rank3_steps2-4.json"
    assert written == [str(trace)] and [p.name for p in tmp_path.iterdir()] == [trace.name]
    events = _events(trace)
    assert _profiled_steps(events) == ["ProfilerStep#3", "ProfilerStep#4"]
    ops = {e["name"] for e in events if e.get("cat") == "cpu_op"}
    assert {"aten::addmm", "aten::mm"} <= ops  # the Linear forward and its weight gradient
    assert any(e.get("args", {}).get("Input Dims") for e in events if e.get("cat") == "cpu_op")  # record_shapes


def test_range_from_zero_profiles_the_first_iteration(tmp_path):
    _train(StepProfiler("0,1", str(tmp_path), rank=0), iterations=3)
    assert _profiled_steps(_events(tmp_path / "trace_rank0_steps0-1.json")) == ["ProfilerStep#1"]


def test_close_writes_the_trace_when_the_run_ends_inside_the_range(tmp_path):
    profiler = StepProfiler("2,10", str(tmp_path), rank=0)
    assert _train(profiler, iterations=4) == []
    assert profiler.close() == str(tmp_path / "trace_rank0_steps2-10.json")
    steps = _profiled_steps(_events(tmp_path / "trace_rank0_steps2-10.json"))
    assert steps[:2] == ["ProfilerStep#3", "ProfilerStep#4"]  # then an empty #5, opened for a step never run
    assert profiler.close() is None  # closing twice is harmless


def test_no_range_profiles_nothing(tmp_path):
    profiler = StepProfiler(None, str(tmp_path / "profile"), rank=0)
    assert _train(profiler, iterations=3) == [] and profiler.close() is None
    assert not (tmp_path / "profile").exists()


@pytest.mark.parametrize("bad", ["4,2", "3,3", "-1,2", "2", "1,2,3", "a,b", "1.5,3", ""])
def test_bad_range_is_a_one_sentence_config_error(bad):
    with pytest.raises(ConfigError, match=r"^--profile-step-range .* must be two integers A,B with 0 <= A < B, e\.g\. 10,12\.$"):
        StepProfiler.parse(bad)


def test_good_range_parses_to_a_pair():
    assert StepProfiler.parse("10,12") == (10, 12) and StepProfiler.parse(" 0, 5") == (0, 5)
