"""scripts/compare_runs.py: a run tracks a reference when its windowed loss means stay close."""
from __future__ import annotations

import importlib.util
import json
import math
import os
import sys
from harness import run_command

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _write(path, losses, start=1):
    with open(path, "w") as f:
        for i, loss in enumerate(losses, start=start):
            f.write(json.dumps({"iteration": i, "loss": loss, "lr": 1e-3}) + "\n")
    return str(path)


def _run(*args):
    result = run_command([sys.executable, "scripts/compare_runs.py", *map(str, args)], cwd=ROOT,
                            capture_output=True, text=True, timeout=60)
    return result.returncode, result.stdout, result.stderr


def _curve(steps, wobble=0.0):
    # a falling loss with step-to-step noise of relative size ``wobble`` that averages out over 10 steps
    return [(2.0 + 8.0 * math.exp(-s / 40)) * (1 + wobble * (-1) ** s) for s in range(1, steps + 1)]


def test_a_run_whose_windowed_means_stay_close_tracks(tmp_path):
    ref = _write(tmp_path / "one.jsonl", _curve(200))
    other = _write(tmp_path / "eight.jsonl", _curve(200, wobble=0.03))  # 3% per step, ~0% per window
    code, out, err = _run(ref, other, "--window", "10", "--tolerance", "0.01")
    assert code == 0, out + err
    assert "tracks" in out and len(out.splitlines()) == 1 + 20 + 1
    assert "largest windowed gap 0.0" in out.splitlines()[-1]  # < 0.1%


def test_a_run_that_drifts_away_diverges_with_exit_1(tmp_path):
    ref = _write(tmp_path / "one.jsonl", _curve(200))
    drifting = _write(tmp_path / "eight.jsonl", [x * (1 + 0.0005 * s) for s, x in enumerate(_curve(200))])
    code, out, _ = _run(ref, drifting, "--tolerance", "0.05")
    assert code == 1 and "DIVERGES" in out and "steps 191-200" in out


def _late(curve, steps, gap):
    # the same curve with a transient bump of relative size ``gap`` around step 80 (a phase learned later)
    return [x * (1 + gap * math.exp(-((s - 80) / 15) ** 2)) for s, x in enumerate(curve, start=1)]


def test_a_rounding_only_control_widens_the_tolerance_by_its_own_gap(tmp_path):
    # A MoE model's curves part by 3-6% around a fast phase in any layout (4 H200s: one GPU with micro-batches of 1
    # sat 3.5% from one GPU with 2): the tolerance is counted beyond what the control shows in the same call.
    ref = _write(tmp_path / "one.jsonl", _curve(200))
    control = _write(tmp_path / "mb1.jsonl", _late(_curve(200), 200, 0.035))
    layout = _write(tmp_path / "ep.jsonl", _late(_curve(200), 200, 0.055))
    code, out, _ = _run(ref, layout, "--tolerance", "0.03")
    assert code == 1 and "DIVERGES" in out
    code, out, _ = _run(ref, layout, "--tolerance", "0.03", "--control", control)
    assert code == 0 and "tracks" in out and "beyond the control's own 3.10%: 6.10% in all" in out.splitlines()[-1]


def test_a_layout_beyond_the_control_by_more_than_the_tolerance_still_diverges(tmp_path):
    ref = _write(tmp_path / "one.jsonl", _curve(200))
    control = _write(tmp_path / "mb1.jsonl", _late(_curve(200), 200, 0.01))
    wrong = _write(tmp_path / "ep.jsonl", [x * (1 + 0.0005 * s) for s, x in enumerate(_curve(200))])  # drifts to +10%
    code, out, _ = _run(ref, wrong, "--tolerance", "0.03", "--control", control)
    assert code == 1 and "DIVERGES" in out


def test_runs_that_logged_different_steps_are_one_sentence_and_exit_2(tmp_path):
    ref = _write(tmp_path / "one.jsonl", _curve(200))
    short = _write(tmp_path / "eight.jsonl", _curve(150))
    code, _, err = _run(ref, short)
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and "different iterations (first difference: 151)" in lines[0]


def test_a_file_that_is_not_a_metrics_file_is_one_sentence_and_exit_2(tmp_path):
    ref = _write(tmp_path / "one.jsonl", _curve(20))
    bad = tmp_path / "log.txt"
    bad.write_text("iter 1 | loss 3.2\n")
    code, _, err = _run(ref, bad)
    assert code == 2 and err.strip() == f"error: {bad}, line 1: not a JSON record (is this a --metrics-file?)."


def test_several_runs_figures_are_shown_side_by_side_and_drawn(tmp_path):
    paths = []
    for run, (mfu, exposed) in enumerate([(0.45, 0.05), (0.38, 0.32), (0.30, 0.41)]):
        path = tmp_path / f"run{run}.jsonl"
        with open(path, "w") as f:
            for i in range(1, 21):
                record = {"iteration": i, "loss": 3.0 - 0.01 * i, "mfu": mfu, "grad_noise_scale": 100.0 * i}
                if i % 5 == 0:  # a sampled step's figures come on the logged step after it
                    record.update(exposed_comm_share=exposed, comm_sampled_iteration=i)
                f.write(json.dumps(record) + "\n")
        paths.append(str(path))
    draws = importlib.util.find_spec("matplotlib") is not None  # the plot needs the bench extra; the table does not
    code, out, err = _run("--series", "mfu,exposed_comm_share,grad_noise_scale", *paths, "--skip", "4",
                          *(["--plot", tmp_path / "runs.png"] if draws else []))
    assert code == 0, err
    lines = out.splitlines()
    exposed = lines[lines.index(next(line for line in lines if line.startswith("exposed_comm_share"))) + 1:][:3]
    assert [line.split()[1:] for line in exposed] == [["4", "5.0%", "5.0%", "5.0%"], ["4", "32.0%", "32.0%", "32.0%"],
                                                      ["4", "41.0%", "41.0%", "41.0%"]]
    noise = lines[lines.index(next(line for line in lines if line.startswith("grad_noise_scale"))) + 1].split()
    assert noise[1:] == ["16", "500", "1,250", "2,000"]  # iterations 5..20 after --skip 4
    if draws:
        assert (tmp_path / "runs.png").stat().st_size > 0 and out.splitlines()[-1] == f"wrote {tmp_path / 'runs.png'}"


def test_the_loss_check_takes_exactly_two_runs(tmp_path):
    runs = [_write(tmp_path / f"{n}.jsonl", _curve(20)) for n in "abc"]
    code, _, err = _run(*runs)
    assert code == 2 and "the loss check compares two runs" in err
