"""ZeRO-3 with parameters and optimizer offloaded to CPU, and to NVMe (ZeRO-Infinity), trains."""
from __future__ import annotations

import ctypes.util
import os

import pytest

from deepspeed_ops import load_nvme_ops
from harness import run_ranks
from oracle import TINY, ds_config


def _train(flags: list[str], swap_dir: str | None = None) -> dict:
    from hybridlm.training.trainer import pretrain
    losses = [r["loss"] for r in pretrain(flags)]
    swapped = []
    if swap_dir:
        for root, _, names in os.walk(swap_dir):
            swapped += [os.path.getsize(os.path.join(root, n)) for n in names if n.endswith(".swp")]
    return {"losses": losses, "swap_files": swapped}


STEPS = ["--train-iters", "12", "--log-interval", "4", "--lr", "3e-3"]


def test_zero3_with_cpu_offload_of_parameters_and_optimizer_trains():
    result = run_ranks(2, _train, TINY + STEPS + ds_config("zero3_offload_cpu"))[0]
    assert result["losses"][-1] < result["losses"][0]


@pytest.mark.ops_build(deepspeed="AsyncIOBuilder")  # conftest.py starts this build when the suite starts
@pytest.mark.skipif(ctypes.util.find_library("aio") is None, reason="libaio (Debian: libaio-dev) is not installed")
def test_zero3_with_nvme_offload_swaps_to_disk_and_trains(tmp_path):
    # Partitions under 1 MiB are kept in memory by DeepSpeed, so the model is wide enough to swap.
    wide = ["--hidden-size", "512", "--num-layers", "2", "--ffn-hidden-size", "1536", "--num-attention-heads", "8",
            "--num-query-groups", "8", "--lr", "1e-3"]
    load_nvme_ops()  # DeepSpeed's async_io op, built as one unit (deepspeed_ops.py), found there by the forked ranks
    result = run_ranks(2, _train, TINY + STEPS + wide + ["--nvme-path", str(tmp_path)] + ds_config("zero3_offload_nvme"),
                       str(tmp_path), timeout=900)[0]
    assert result["losses"][-1] < result["losses"][0]
    assert result["swap_files"] and min(result["swap_files"]) >= 2**20, "nothing was swapped to the NVMe path"
