"""The start-up line (hybridlm/training/setup_clock.py): where a job's seconds before its first step went."""
from hybridlm.training import setup_clock
from hybridlm.training.setup_clock import SetupClock


def test_the_line_names_each_phase_in_order_and_its_total_is_their_sum(monkeypatch):
    clock = SetupClock()
    monkeypatch.setattr(clock, "before_the_job", lambda: 4.0)
    clock.phases.update({"process groups": 1.25, "model": 2.0, "engine": 3.5, "data": 0.01})
    assert clock.line() == "set-up 10.8 s: imports 4.0, process groups 1.2, model 2.0, engine 3.5 (seconds)"


def test_a_phase_entered_twice_adds_up_and_a_failing_phase_still_counts(monkeypatch):
    ticks = iter([10.0, 12.0, 20.0, 21.5, 30.0, 30.5])
    monkeypatch.setattr(setup_clock.time, "perf_counter", lambda: next(ticks))
    clock = SetupClock()
    for _ in range(2):
        with clock.phase("checkpoint"):
            pass
    try:
        with clock.phase("engine"):
            raise RuntimeError("DeepSpeed refused")
    except RuntimeError:
        pass
    assert clock.phases == {"checkpoint": 3.5, "engine": 0.5}


def test_without_the_process_start_the_line_leaves_imports_out(monkeypatch):
    clock = SetupClock()
    monkeypatch.setattr(clock, "before_the_job", lambda: None)
    clock.phases["model"] = 1.0
    assert clock.line() == "set-up 1.0 s: model 1.0 (seconds)"
