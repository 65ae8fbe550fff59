"""Bad input ends in one sentence naming the flag or file, exit code 2, on every rank,
before any process group exists (so no rank can hang waiting for another)."""
from __future__ import annotations

import contextlib
import io
import json
import os

import pytest

from harness import run_ranks
from oracle import ROOT, TINY, ds_config


def _main_on_rank_after_setup(argv: list[str]) -> tuple[int, str]:
    from hybridlm.training.trainer import main
    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr):
        code = main(argv)
    return code, stderr.getvalue()


def _main_on_rank(argv: list[str]) -> tuple[int, str]:
    result = _main_on_rank_after_setup(argv)
    import torch.distributed as dist
    assert not dist.is_initialized(), "a process group was created before the input was validated"
    return result


def _bad_json(tmp_path) -> str:
    path = tmp_path / "broken.json"
    path.write_text('{"zero_optimization": {"stage": 1,}\n}')
    return str(path)


def _concrete_micro_batch_json(tmp_path) -> str:
    path = tmp_path / "mbs8.json"
    path.write_text(json.dumps({"train_micro_batch_size_per_gpu": 8, "zero_optimization": {"stage": 1}}))
    return str(path)


CASES = [
    pytest.param(2, ["--num-attention-heads", "3", "--num-query-groups", "3", "--hidden-size", "48",
                     "--tensor-model-parallel-size", "2"] + ds_config("zero1"),
                 "--num-attention-heads 3 is not divisible by --tensor-model-parallel-size 2", id="heads_not_divisible_by_tp"),
    pytest.param(3, ["--tensor-model-parallel-size", "2"] + ds_config("zero1"),
                 "world size 3 is not a multiple of TP x PP = 2 x 1", id="world_not_tp_pp_dp"),
    pytest.param(2, ["--num-layers", "1", "--pipeline-model-parallel-size", "2"] + ds_config("zero1"),
                 "--pipeline-model-parallel-size 2 exceeds --num-layers 1", id="pp_exceeds_layers"),
    pytest.param(2, ["--pipeline-model-parallel-size", "2"] + ds_config("zero2"),
                 "ZeRO stage 2", id="zero2_with_pp"),
    pytest.param(2, ["--pipeline-model-parallel-size", "2"] + ds_config("zero3"),
                 "cannot be combined with --pipeline-model-parallel-size 2", id="zero3_with_pp"),
    pytest.param(2, ["--deepspeed_config", "/nonexistent/ds.json"],
                 "--deepspeed_config /nonexistent/ds.json: no such file", id="missing_json"),
    pytest.param(2, ["--deepspeed_config", "BAD_JSON"], "invalid JSON at line 1", id="malformed_json"),
    pytest.param(2, ["--manual-gc-interval", "5"] + ds_config("zero1"), "--manual-gc-interval 5 needs --manual-gc",
                 id="gc_interval_without_manual_gc"),
    pytest.param(2, ["--global-batch-size", "6", "--micro-batch-size", "2"] + ds_config("zero1"),
                 "--global-batch-size 6 is not divisible by --micro-batch-size x DP = 2 x 2", id="batch_not_divisible"),
    pytest.param(1, ["--micro-batch-size", "4", "--deepspeed_config", "MBS8_JSON"],
                 "--micro-batch-size 4 conflicts with \"train_micro_batch_size_per_gpu\": 8", id="flag_conflicts_with_json"),
    pytest.param(2, ["--num-query-groups", "3", "--num-attention-heads", "6", "--hidden-size", "48",
                     "--tensor-model-parallel-size", "2"] + ds_config("zero1"),
                 "--num-query-groups 3 is not divisible by --tensor-model-parallel-size 2", id="groups_not_divisible_by_tp"),
    pytest.param(2, ["--context-parallel-size", "2", "--seq-length", "30"] + ds_config("zero1"),
                 "--seq-length 30 is not divisible by 2 x CP = 4", id="seq_not_divisible_by_2cp"),
]


@pytest.mark.parametrize("world, flags, sentence", CASES)
def test_bad_input_is_one_sentence_and_exit_2_on_every_rank(tmp_path, world, flags, sentence):
    flags = [_bad_json(tmp_path) if f == "BAD_JSON" else _concrete_micro_batch_json(tmp_path) if f == "MBS8_JSON" else f
             for f in flags]
    results = run_ranks(world, _main_on_rank, TINY + flags, timeout=60)
    for rank, (code, stderr) in enumerate(results):
        assert code == 2, f"rank {rank} exited {code}"
        lines = [line for line in stderr.splitlines() if line.strip()]
        assert len(lines) == 1 and lines[0].startswith("error: "), f"rank {rank} printed {stderr!r}"
        assert sentence in lines[0], f"rank {rank}: {lines[0]!r} does not say {sentence!r}"


def test_unknown_flag_is_refused_by_argparse(capsys):
    from hybridlm.training.trainer import main
    with pytest.raises(SystemExit) as exit_info:
        main(["--hidden-sise", "64"])
    assert exit_info.value.code == 2
    assert "unrecognized arguments: --hidden-sise" in capsys.readouterr().err


def test_shipped_ds_configs_are_valid_json_with_auto_batch_sizes():
    folder = os.path.join(ROOT, "ds_configs")
    names = sorted(n[:-5] for n in os.listdir(folder) if n.endswith(".json"))
    assert names == ["zero0", "zero1", "zero1_offload_cpu", "zero2", "zero3", "zero3_offload_cpu", "zero3_offload_nvme"]
    for name in names:
        with open(os.path.join(folder, f"{name}.json")) as f:
            ds = json.load(f)
        assert ds["train_micro_batch_size_per_gpu"] == "auto" and ds["train_batch_size"] == "auto", name
        assert ds["bf16"]["enabled"] == "auto" and ds["fp16"]["enabled"] == "auto", name


def test_consecutive_skipped_steps_stop_the_run_with_a_clear_message():
    # A learning rate of 1e30 makes step 2's gradients non-finite; ZeRO skips each such step.
    flags = TINY + ds_config("zero1") + ["--lr", "1e30", "--lr-warmup-iters", "0", "--train-iters", "20",
                                         "--max-bad-steps", "3"]
    code, stderr = run_ranks(2, _main_on_rank_after_setup, flags)[0]
    assert code == 3
    assert "3 consecutive steps were skipped for overflowing or non-finite gradients" in stderr

