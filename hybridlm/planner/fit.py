"""Refuse at start-up a run that the memory planner says cannot fit on this GPU.

Without this, a run too long for its GPUs (a 1M-token sequence on too few CP ranks, say) spends
minutes starting DeepSpeed, building the model and compiling, and then dies of a CUDA out-of-memory
error on some rank, deep in a stack trace. The planner (``memory.estimate``) predicts the peak of
the same flags; checked against measured peaks (tests/test_planner.py on CPU ranks, and on GPUs
e.g. 256K tokens on one H200: 82.2 GiB planned, 84.4 measured; 128K at CP=2 on H100s: 25.9
planned, 25.1 measured) it is within a few percent, and the issue it serves asks for 15%. So a run
is refused only when even ``1 - ACCURACY`` of the planned peak exceeds the device's memory: a clear
case, never a run that might have fitted. ``--skip-memory-check`` starts it anyway.

The check runs in ``prepare_config``, before any process group, on CUDA devices only (a CPU
rank's memory is the host's, shared by every rank).
"""
from __future__ import annotations

import os
from typing import Optional

import torch

from ..config import ConfigError
from ..model.attention_backends import resolve_backend
from ..ops.select import DEFAULT_FUSED
from .memory import GIB, Breakdown, estimate, layout_from_run

ACCURACY = 0.15  # the planner's promised accuracy against measured peaks


def device_memory_bytes() -> Optional[int]:
    """This rank's GPU memory (its LOCAL_RANK's device), or None where there is no CUDA device."""
    if not torch.cuda.is_available():
        return None
    local = int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count()
    return torch.cuda.get_device_properties(local).total_memory


def planned_peak(cfg, ds: dict, device_type: str = "cuda") -> Breakdown:
    """The planner's peak for a validated RunConfig and its DeepSpeed JSON, with the attention kernel
    and fused kernels this run will use on ``device_type`` ("cuda" or "cpu")."""
    m = cfg.model
    backend, _ = resolve_backend(m.attention_backend, m.attention_dropout, m.graphed_attention_shape,
                                 packing=m.packed_samples, half_precision=m.half_precision)
    if device_type == "cpu" and backend == "sdpa" and m.attention_dropout:
        backend = "math"  # torch's CPU flash kernel draws no dropout: SDPA falls back to its math kernel
    names = m.fused_op_names()
    fused = "rmsnorm" in (DEFAULT_FUSED.get(device_type, ()) if names is None else names)
    return estimate(m, layout_from_run(cfg, ds), backend=backend, fused=fused)


def checked(cfg) -> bool:
    """Whether the planner models this run: not with --skip-memory-check, and not LoRA or QLoRA, whose
    frozen base holds no gradients or optimizer states (the planner counts a full fine-tune's)."""
    return not (cfg.train.skip_memory_check or cfg.model.lora_rank)


def check_fits(cfg, ds: dict, device_bytes: int) -> Breakdown:
    """Raise ConfigError (one sentence naming what to change) when the run cannot fit ``device_bytes``
    even if the planner overestimates by ``ACCURACY``; returns the planned peak otherwise."""
    peak = planned_peak(cfg, ds)
    if peak.total * (1 - ACCURACY) <= device_bytes:
        return peak
    g = peak.gib()
    states = g["parameters"] + g["gradients"] + g["optimizer"]
    activations = g["activations"] + g["logits"]
    need = (f"about {g['total']:.1f} GiB per GPU by the memory planner, more than this GPU's "
            f"{device_bytes / GIB:.1f} GiB even if the planner is {ACCURACY:.0%} high")
    if activations >= states:
        m, p, t = cfg.model, cfg.parallel, cfg.train
        raise ConfigError(
            f"--seq-length {m.seq_length} x --micro-batch-size {t.micro_batch_size} at --context-parallel-size "
            f"{p.context_parallel_size} needs {need} (activations {g['activations']:.1f} GiB, logits {g['logits']:.1f} GiB): "
            "raise --context-parallel-size, lower --seq-length or --micro-batch-size, or add --recompute-granularity full "
            "(scripts/plan.py lists layouts that fit); --skip-memory-check starts it anyway.")
    raise ConfigError(
        f"The model's states need {need} (parameters {g['parameters']:.1f}, gradients {g['gradients']:.1f}, optimizer "
        f"{g['optimizer']:.1f} GiB): raise --tensor-model-parallel-size or --pipeline-model-parallel-size, or use ZeRO-3 or "
        "CPU offload (ds_configs/zero3*.json; scripts/plan.py lists layouts that fit); --skip-memory-check starts it anyway.")
