"""The benchmark suite (python -m benchmarks): cases as data, one runner, records that render
RESULTS.md, the README's headline table and the plot."""
from __future__ import annotations

import json
import os
import sys
import tarfile

import pytest
import torch

from benchmarks import megatron, records, render, runner
from benchmarks.cases import BY_NAME, CASES, ONE_GPU_PEERS, PEERS, SUITES, Case
from hybridlm.config import parse_args
from hybridlm.training.metrics import flops_per_token
from harness import run_command

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_the_cpu_case_runs_through_the_runner_into_a_record_and_a_table_row(tmp_path):
    """Two steps of the built-in tiny model through `python -m benchmarks run`: the launcher, scripts/benchmark.py,
    the record it writes and the suite's table rendered from it."""
    out = tmp_path / "out"
    result = run_command([sys.executable, "-m", "benchmarks", "run", "--cases", "cpu-tiny", "--out", str(out)], cwd=ROOT,
                            capture_output=True, text=True, timeout=240, env=dict(os.environ, DS_ACCELERATOR="cpu"))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert result.stdout.strip().splitlines()[-1].startswith("cpu-tiny ")  # the table comes last
    (record,) = records.read(str(out / "records.jsonl"))
    assert record["status"] == "ok" and record["case"] == "cpu-tiny" and record["system"] == "hybridlm"
    for key in ("call", "date", "device", "commit", "tokens_per_sec_per_gpu", "tflops_per_gpu", "mfu", "peak_memory_gib"):
        assert key in record, key
    assert len(record["step_tokens_per_sec_per_gpu"]) == 2 and record["tokens_per_sec_per_gpu"] > 0
    assert record["command"].startswith("deepspeed --num_gpus 1 scripts/benchmark.py --model tiny --steps 2 --warmup 1")
    assert record["flops_per_token"] == pytest.approx(flops_per_token(records.model_config(record["model_args"])))
    with tarfile.open(out / "logs.tar.gz") as tar:
        assert "logs/cpu-tiny.hybridlm.log" in tar.getnames()
    table = "\n".join(render.suite_markdown("cpu", [record]))
    assert f"| {record['tokens_per_sec_per_gpu']:,.0f} |" in table and f"- c1: `{record['command']}`" in table


def test_readme_and_results_are_what_the_records_render():
    stale = render.stale(records.load_all())
    assert not stale, f"{stale} differ from what benchmarks/records/ renders: run python -m benchmarks render"


def test_the_plot_draws_each_readme_case_beside_its_peers(tmp_path):
    pytest.importorskip("matplotlib", reason="the plot needs matplotlib (pip install -e '.[bench]')")
    stored = records.load_all()
    bars = render.plot(stored, str(tmp_path / "plot.png"))
    assert (tmp_path / "plot.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert [(name, system) for name, system, _, _ in bars] == [(n, s) for n, s, _, _ in render.headline_rows(stored)]
    assert ("ref-bf16", "torch-compile") in [(n, s) for n, s, _, _ in bars]


def _timed(call, system, tps, case="ref-bf16", **extra):
    return {"call": call, "case": case, "system": system, "date": "2026-11-30", "status": "ok",
            "tokens_per_sec_per_gpu": tps, "command": f"cmd {call}", **extra}


def test_a_ratio_comes_from_the_same_call_or_says_it_does_not():
    stored = [_timed("a", "hybridlm", 120.0), _timed("a", "megatron-lm", 100.0), _timed("b", "torch", 60.0)]
    assert render.ratio(stored[1], stored) == "1.20x"
    assert render.ratio(stored[2], stored) == "2.00x (different calls: hybridlm's of 2026-11-30)"
    assert render.ratio(stored[0], stored) == ""


def _curve_record(call, layout, gap, verdict, label):
    return {"call": call, "case": "curve-dense-4gpu-c", "suite": "scaling", "system": "hybridlm", "date": "2026-11-30",
            "time": f"2026-11-30T{call}", "device": "4x H200", "commit": "abc1234", "status": "ok",
            "label": f"Llama-style d1024 L10: {label} vs 1 GPU, bf16", "curve": {"layout": layout},
            "figures": {"max windowed loss gap": f"{gap} (window 10, after step 10)", "verdict": verdict}}


def test_the_layouts_table_shows_each_layouts_newest_gap_beside_its_own_calls_control_and_names_the_missing():
    stored = [_curve_record("01", "cp4-p2p", "0.90%", "tracks", "CP=4 p2p"),
              _curve_record("01", "1gpu-mb2", "0.80%", "rounding-only control", "1 GPU, micro-batches of 2 (rounding only)"),
              _curve_record("02", "cp4-p2p", "0.53%", "tracks", "CP=4 p2p"),
              _curve_record("02", "1gpu-mb2", "0.47%", "rounding-only control", "1 GPU, micro-batches of 2 (rounding only)")]
    rows = [line for line in render.layouts_table(stored).splitlines() if "curve-dense-4gpu-c" in line or "CP=4" in line]
    assert rows[0] == ("| `curve-dense-4gpu-c` | CP=4 p2p | 0.53% | 0.47% (1 GPU, micro-batches of 2) | tracks | "
                       "2026-11-30, 4x H200, abc1234 |")
    assert rows[1] == "|  | CP=4 a2a | | | no record | `python -m benchmarks run --cases curve-dense-4gpu-c` |"
    readme = render.rendered_readme(f"x {render.BEGIN}{render.END} {render.LAYOUTS_BEGIN}old{render.LAYOUTS_END}", stored)
    assert rows[0] in readme and "old" not in readme


def test_figures_are_rederived_by_the_current_rule_and_say_which_rule():
    args = ["--model", "reference", "--bf16"]
    per_token = flops_per_token(records.model_config(args))
    measured = records.throughput({"tokens_per_sec_per_gpu": 1e5, "model_args": args, "peak_tflops": 989.0,
                                   "flops_per_token": per_token})
    assert measured.rule == "current" and measured.tflops_per_gpu == pytest.approx(1e5 * per_token / 1e12)
    old = records.throughput({"tokens_per_sec_per_gpu": 1e5, "model_args": args, "peak_tflops": 989.0,
                              "tflops_per_gpu": 1.0, "mfu": 0.001, "mfu_rule": "old rule"})
    assert old.rule == "re-derived (new rule)" and old.mfu == pytest.approx(1e5 * per_token / 1e12 / 989.0)
    unknown = records.throughput({"tokens_per_sec_per_gpu": 1e5, "tflops_per_gpu": 1.0, "mfu": 0.001, "mfu_rule": "old rule"})
    assert unknown == records.Throughput(1e5, 1.0, 0.001, "old rule")


def test_every_case_is_well_formed_and_its_flags_validate():
    assert len(BY_NAME) == len(CASES)
    for case in CASES:
        assert case.suite in SUITES and set(case.peers) <= set(PEERS), case.name
        assert case.gpus == 1 or not set(case.peers) & set(ONE_GPU_PEERS), f"{case.name}: baselines.py runs on one GPU"
        if case.script:
            assert os.path.exists(os.path.join(ROOT, case.script[0])), case.script[0]
        else:
            runner.run_config(case)  # raises ConfigError on a bad flag or layout
    assert {c.suite for c in CASES} >= set(SUITES)


def test_every_curve_case_names_layouts_benchmarks_curves_knows():
    from benchmarks.curves import LAYOUTS_4GPU, ONE_GPU_LAYOUTS
    for case in CASES:
        if case.script and case.script[0] == "benchmarks/curves.py" and "--layouts" in case.script:
            kind, names = case.script[1], case.script[case.script.index("--layouts") + 1].split(",")
            assert set(names) <= {*LAYOUTS_4GPU[kind], *ONE_GPU_LAYOUTS[kind]}, case.name


def test_every_gpu_case_expects_to_finish_within_one_device_call():
    """The device tool stops a command at 600 s; a case planned longer than its own limit, or a limit past that
    with the staging around it, dies in the call with the layouts still to run and nothing to show for them."""
    for case in CASES:
        if case.gpus in (1, 2, 4):
            assert case.expected_s <= case.timeout_s <= 590, case.name


def _probe(loss, clip, grad_err, norm=0.9275):
    groups = dict(zip(("dense", "router", "experts"), grad_err))
    return {"loss": loss, "clip_norm": clip, "full_grad_norm": norm, "grad_err_vs_fp32": {**groups, "all": grad_err[0]},
            "grad_norm": {**groups, "all": norm}}


def test_same_weights_verdict_names_a_wrong_gradient_scale_a_wrong_clip_norm_and_a_wrong_loss():
    # figures of the MoE probe from iteration 60 on 4 H200s (benchmarks/records), then one fault at a time
    from benchmarks.same_weights import REFERENCE, SAVER, judge
    probes = {SAVER: _probe(2.2853, 0.9276, (4.1e-2, 4.4e-2, 4.3e-2), 0.9276),
              "1 GPU bf16 mb 1": _probe(2.2853, 0.9280, (4.1e-2, 7.0e-2, 4.4e-2), 0.9280),
              REFERENCE: _probe(2.2850, 0.9373, (0.0, 0.0, 0.0), 0.9373),
              "EP2 x DP2": _probe(2.2853, 0.9275, (4.1e-2, 4.4e-2, 4.3e-2))}
    assert not any(judge(probes).values())
    scaled = {**probes, "EP2 x DP2": _probe(2.2853, 0.9275, (4.1e-2, 4.4e-2, 1.0))}  # expert gradients EP times too large
    assert judge(scaled)["EP2 x DP2"].startswith("experts gradient 1.0e+00 from fp32")
    summed = {**probes, "EP2 x DP2": _probe(2.2853, 1.1131, (4.1e-2, 4.4e-2, 4.3e-2))}  # a clip norm over the wrong ranks
    assert judge(summed)["EP2 x DP2"].startswith("clipped with norm 1.1131")
    off = {**probes, "EP2 x DP2": _probe(2.3100, 0.9275, (4.1e-2, 4.4e-2, 4.3e-2))}
    assert judge(off)["EP2 x DP2"].startswith("loss 2.3100")


def test_megatron_gets_the_cases_model_batch_and_its_best_flags():
    args = megatron.megatron_args(runner.run_config(BY_NAME["ref-bf16"]), iters=20)
    value = {flag: args[i + 1] for i, flag in enumerate(args[:-1]) if flag.startswith("--") and not args[i + 1].startswith("--")}
    ref = parse_args(["--model", "reference"]).model
    assert {k: value[k] for k in ("--num-layers", "--hidden-size", "--num-attention-heads", "--ffn-hidden-size", "--seq-length",
                                  "--vocab-size", "--micro-batch-size", "--global-batch-size", "--normalization")} == {
        "--num-layers": str(ref.num_layers), "--hidden-size": str(ref.hidden_size), "--num-attention-heads": str(ref.num_attention_heads),
        "--ffn-hidden-size": str(ref.ffn_hidden_size), "--seq-length": str(ref.seq_length), "--vocab-size": str(ref.vocab_size),
        "--micro-batch-size": "4", "--global-batch-size": "64", "--normalization": ref.normalization}
    assert {"--swiglu", "--untie-embeddings-and-output-weights", "--disable-bias-linear", "--bf16", "--mock-data",
            "--use-distributed-optimizer", "--cross-entropy-loss-fusion", "--no-create-attention-mask-in-dataloader"} <= set(args)
    assert value["--transformer-impl"] == "transformer_engine" and value["--attention-backend"] == "fused"  # cuDNN through TE
    assert "--fp8-format" not in args and "--cuda-graph-impl" not in args
    fp8 = megatron.megatron_args(runner.run_config(BY_NAME["ref-fp8"]), iters=20)
    assert fp8[fp8.index("--fp8-format") + 1] == "hybrid" and fp8[fp8.index("--cuda-graph-impl") + 1] == "transformer_engine"


def test_megatron_log_gives_median_tokens_per_second_after_the_warmup():
    line = (" [2026-11-30 10:00:0{i}.000000] iteration        {i}/      5 | consumed samples:          {s} | "
            "elapsed time per iteration (ms): {ms:.1f} | throughput per GPU (TFLOP/s/GPU): {tf:.1f} | learning rate: 1.0E-04 |"
            " global batch size:    64 | lm loss: 1.050000E+01 | loss scale: 1.0 | grad norm: 1.000 |")
    log = "\n".join(line.format(i=i, s=64 * i, ms=ms, tf=tf) for i, ms, tf in
                    [(1, 9000.0, 1.0), (2, 1000.0, 700.0), (3, 1100.0, 650.0), (4, 1000.0, 700.0), (5, 1200.0, 600.0)])
    log += f"\n{megatron.PEAK_LINE} 25.500\n{megatron.DEVICE_LINE} 989.0\n"
    got = megatron.parse_log(log, tokens_per_iteration=64 * 2048, world=1, warmup=1)
    assert got["step_tokens_per_sec_per_gpu"] == pytest.approx([131072.0, 131072 / 1.1, 131072.0, 131072 / 1.2])
    assert got["tokens_per_sec_per_gpu"] == pytest.approx((131072.0 + 131072 / 1.1) / 2)
    assert got["peer_reported_tflops_per_gpu"] == 675.0 and got["peak_memory_gib"] == 25.5 and got["final_loss"] == 10.5
    assert got["peak_tflops"] == 989.0
    with pytest.raises(ValueError, match="no iteration after the first 5"):
        megatron.parse_log(log, tokens_per_iteration=1, world=1, warmup=5)


def test_a_call_over_its_budget_leaves_the_rest_for_a_second_call(tmp_path, capsys):
    call = runner.Call(out=str(tmp_path), budget_s=1, commit="test")
    assert runner.run([BY_NAME["cpu-tiny"]], call) == []
    out = capsys.readouterr().out
    assert "cpu-tiny / hybridlm: the call's budget" in out
    assert out.strip().splitlines()[-1] == "  the rest: python -m benchmarks run --cases cpu-tiny --systems hybridlm --out $OUT"


def test_cases_this_machine_cannot_run_are_named_not_failed(tmp_path):
    call = runner.Call(out=str(tmp_path), commit="test")
    wide = Case("wide", "scaling", "x", gpus=8, peers=("megatron-lm",))
    assert runner.plan([wide], None, call) == []
    assert [(c, s) for c, s, _ in call.not_run] == [("wide", "hybridlm"), ("wide", "megatron-lm")]


SMALL = ("--num-layers", "2", "--hidden-size", "256", "--num-attention-heads", "4", "--ffn-hidden-size", "704",
         "--seq-length", "256", "--micro-batch-size", "2", "--global-batch-size", "4", "--vocab-size", "1024", "--bf16")


@pytest.mark.gpu
@pytest.mark.parametrize("system", ["hybridlm", "torch-compile", "hf-zero2"])
def test_hybridlm_and_each_baseline_write_their_record_on_one_gpu(tmp_path, system):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    case = Case("gpu-small", "cpu", "d256 L2, bf16", flags=SMALL, steps=3, warmup=2)
    (record,) = runner.run_one(case, system, runner.Call(out=str(tmp_path), commit="test"))
    assert record["status"] == "ok", record.get("error")
    assert record["system"] == system and len(record["step_tokens_per_sec_per_gpu"]) == 3 and record["peak_memory_gib"] > 0
    assert records.throughput(record).rule == "current"


@pytest.mark.gpu
def test_megatron_peer_runs_a_small_model_from_the_staged_source(tmp_path):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    src = megatron.source_dir(None)
    if src is None:
        pytest.skip("no Megatron-LM source: benchmarks/stage.sh stages it into .device/megatron")
    case = Case("megatron-small", "cpu", "d256 L2, bf16", flags=SMALL, steps=3, warmup=2, peers=("megatron-lm",))
    call = runner.Call(out=str(tmp_path), commit="test", megatron_src=src)
    (record,) = runner.run_one(case, "megatron-lm", call)
    assert record["status"] == "ok", record.get("error")
    assert len(record["step_tokens_per_sec_per_gpu"]) == 3 and record["peak_memory_gib"] > 0
    assert json.loads(json.dumps(record)) == record


def test_a_call_runs_hybridlm_and_megatron_of_every_case_before_the_other_peers(tmp_path, monkeypatch):
    monkeypatch.setattr(runner, "device_count", lambda: 1)
    monkeypatch.setattr(runner, "missing", lambda case, gpus: None)
    call = runner.Call(out=str(tmp_path), commit="test", megatron_src=str(tmp_path))
    order = [(case.name, system) for case, system in runner.plan([BY_NAME["ref-bf16"], BY_NAME["ref-fp8"]], None, call)]
    assert order == [("ref-bf16", "hybridlm"), ("ref-bf16", "megatron-lm"), ("ref-fp8", "hybridlm"), ("ref-fp8", "megatron-lm"),
                     ("ref-bf16", "torch-compile"), ("ref-bf16", "hf-zero2"), ("ref-bf16", "torch")]


def test_a_rank_killed_without_a_traceback_is_reported_as_killed_not_as_the_launchers_last_line():
    log = ("hybridlm: ParallelState(...) | ZeRO=3\n[INFO] [launch.py:253:sigkill_handler] Killing subprocess 553\n"
           "[ERROR] [launch.py:259:sigkill_handler] ['python3', 'scripts/benchmark.py'] exits with return code = -9\n")
    assert runner.error_line(1, log).startswith("a rank was killed (SIGKILL")
    assert runner.error_line(1, "Traceback\nValueError: bad\n") == "ValueError: bad (exit 1)"


def test_sft_records_carry_both_targets_ratios_and_a_failed_run_stays_a_failed_record():
    import argparse
    from benchmarks import sft_throughput
    results = {"sft": {"loss_tokens_per_sec": 900.0, "positions_per_sec": 2000.0, "peak_memory_gib": 3.0},
               "trl": {"loss_tokens_per_sec": 600.0, "positions_per_sec": 1900.0, "trl": "1.16.0", "attn_implementation": "sdpa"},
               "pretrain": {}}
    args = argparse.Namespace(tiny=True, seq_length=256, micro_batch_size=1, global_batch_size=4, hybridlm_flags="", pairs=8)
    records = {r["system"] + ":" + r["label"].split(",")[0]: r for r in sft_throughput.records_of(results, args, ["--tiny"])}
    sft = records["hybridlm:SFT"]
    assert sft["figures"]["hybridlm/TRL"] == "1.50x" and "SFT/pretraining" not in sft["figures"]
    assert records["hybridlm:pretraining"]["status"] == "failed" and "status" not in sft
    assert sft["command"] == "python benchmarks/sft_throughput.py --tiny"


def test_grpo_records_carry_the_ratio_and_a_failed_run_stays_a_failed_record():
    import argparse
    from benchmarks import grpo_throughput
    run = {"completions_per_sec": 6.0, "step_seconds": 10.7, "rollout_seconds": 8.0, "rest_seconds": 2.7,
           "rollout_tokens_per_sec": 4000.0, "mean_length": 512, "peak_memory_gib": 20.0}
    args = argparse.Namespace(tiny=False, num_generations=8, max_completion_length=512, global_batch_size=64, micro_batch_size=8,
                              hybridlm_flags="")
    records = grpo_throughput.records_of({"grpo": run, "trl": {**run, "completions_per_sec": 2.0, "trl": "1.16.0"}}, args, [])
    assert records[0]["system"] == "hybridlm" and records[0]["figures"]["hybridlm/TRL"] == "3.00x"
    assert records[1]["system"] == "trl" and "TRL 1.16.0 GRPOTrainer" in records[1]["label"]
    failed = grpo_throughput.records_of({"grpo": run, "trl": {}}, args, [])
    assert failed[1]["status"] == "failed" and "hybridlm/TRL" not in failed[0]["figures"]
