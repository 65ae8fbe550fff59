"""--check-weight-hash-across-dp-replicas-interval N (Megatron's flag): replicas that must hold the same weights are
compared every N steps, and a rank whose copy differs stops the run with one sentence naming the iteration, the
ranks and the first parameter, before a checkpoint of the diverged copies is written.

The hash is tested on its own (exact, position-sensitive); the check on real gloo ranks with one rank's weights
nudged (tests/replica_runs.py), across data- and context-parallel replicas of the dense weights and across the
expert-data-parallel replicas of the experts; on two GPUs through NCCL.
"""
from __future__ import annotations

import os
import sys

import pytest
import torch

from harness import run_command, run_ranks
from oracle import ROOT, TINY, ds_config

INTERVAL = ["--check-weight-hash-across-dp-replicas-interval", "2", "--train-iters", "6", "--log-interval", "1"]


def _hash(t):
    from hybridlm.training.replicas import ReplicaCheck
    return int(ReplicaCheck(torch.nn.Linear(1, 1), None, None).tensor_hash(t))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_hash_is_equal_for_equal_bits_and_changes_with_any_element_or_its_place(dtype):
    x = torch.randn(5_000_001, dtype=torch.float32).to(dtype)  # more than one hashed chunk
    assert _hash(x) == _hash(x.clone())
    last_bit = x.clone()
    last_bit.view(torch.int16 if dtype == torch.bfloat16 else torch.int32)[4_999_999] ^= 1
    swapped = x.clone()
    swapped[[10, 4_500_000]] = x[[4_500_000, 10]]
    moved = torch.roll(x, 1)
    assert len({_hash(x), _hash(last_bit), _hash(swapped), _hash(moved)}) == 4


def _nudged(flags, at, rank, expert=False, save=None):
    """In each rank: train with one rank's weights nudged after iteration ``at``; the stop's message, or None."""
    from replica_runs import nudge_after
    from hybridlm.training.replicas import ReplicasDiverged
    from hybridlm.training.trainer import pretrain
    nudge_after(at, rank, expert)
    try:
        pretrain(flags + (["--save", save, "--save-interval", "2"] if save else []))
    except ReplicasDiverged as e:
        return str(e)
    return None


@pytest.mark.slow
def test_a_data_parallel_replica_nudged_after_step_3_stops_the_run_at_the_check_of_step_4_before_its_checkpoint(tmp_path):
    # ZeRO-0 in fp32: each rank updates its own copy, so the nudge stays (ZeRO-1/2 would overwrite it from the
    # partitions at the next step); the check of step 2 passed, the one of step 4 names the rank.
    flags = ds_config("zero0") + TINY + INTERVAL
    messages = run_ranks(2, _nudged, flags, 3, 1, False, str(tmp_path / "ckpt"))
    assert messages[0] == messages[1], "every rank stops with the same sentence"
    assert messages[0].startswith("iteration 4: replicas that must hold the same weights differ, first at "), messages[0]
    assert "ranks [0] and ranks [1] hold different values" in messages[0]  # two replicas: no majority to trust
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["config.yaml", "ds_config.json", "global_step2", "latest"]


@pytest.mark.slow
def test_context_parallel_replicas_are_compared_too():
    flags = ds_config("zero1") + TINY + INTERVAL + ["--context-parallel-size", "2"]
    messages = run_ranks(2, _nudged, flags, 4, 0)
    assert "iteration 4:" in messages[0] and "ranks [0] and ranks [1] hold different values" in messages[0]


@pytest.mark.slow
def test_an_expert_replica_is_compared_across_expert_data_parallel_ranks_only():
    # DP=4 EP=2: experts 0-1 live on ranks 0 and 2, experts 2-3 on ranks 1 and 3 (expert-DP groups [0, 2], [1, 3])
    flags = ds_config("zero1") + TINY + INTERVAL + ["--num-experts", "4", "--moe-router-topk", "2",
                                                     "--expert-model-parallel-size", "2"]
    messages = run_ranks(4, _nudged, flags, 2, 2, True)
    assert "iteration 2:" in messages[0] and ".mlp.moe.w" in messages[0], messages[0]
    assert "ranks [0] and ranks [2] hold different values" in messages[0]


@pytest.mark.slow
def test_replicas_that_agree_train_to_the_end_under_zero3():
    flags = ds_config("zero3") + TINY + INTERVAL
    assert run_ranks(2, _nudged, flags, 99, 1) == [None, None]


def test_the_interval_must_be_positive():
    from hybridlm.config import ConfigError, parse_args
    from hybridlm.training.trainer import prepare_config
    with pytest.raises(ConfigError, match="--check-weight-hash-across-dp-replicas-interval must be at least 1, got 0"):
        prepare_config(parse_args(["--check-weight-hash-across-dp-replicas-interval", "0"]), world_size=1)


@pytest.mark.gpu
@pytest.mark.gpus(2)
def test_on_two_gpus_a_nudged_replica_stops_every_rank_with_one_sentence(tmp_path):
    flags = ["--deepspeed_config", "ds_configs/zero1.json", *TINY, *INTERVAL, "--bf16", "--save", str(tmp_path / "ckpt"),
             "--save-interval", "2"]
    result = run_command([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                             "tests/replica_runs.py", "--nudge-at", "4", "--nudge-rank", "1", "--", *flags],
                            cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode != 0, "the run went on with diverged replicas"
    lines = [line for line in result.stderr.splitlines() if line.startswith("error: iteration 4: replicas")]
    assert len(lines) == 2 and "ranks [0] and ranks [1] hold different values" in lines[0], result.stderr[-3000:]
    assert "global_step4" not in os.listdir(tmp_path / "ckpt")
