"""TP-aware random streams for dropout, shared with DeepSpeed's activation checkpointing, and
activation recompute itself.

Two streams, as in Megatron:
  * the default generator, seeded identically on every TP rank: dropout on activations
    that are replicated over TP (the residual stream without SP) must draw the same mask;
  * a tracked "model-parallel" stream, seeded differently per TP rank: dropout on
    activations split over TP (attention heads, sequence-parallel slices) must not.

The tracked stream lives in DeepSpeed's own ``CudaRNGStatesTracker`` (it works on any
accelerator, CPU included) because ``deepspeed.checkpointing.checkpoint`` saves and
restores exactly that tracker when it recomputes a layer: masks in the recomputed
forward then equal the original ones.
"""
from __future__ import annotations

import contextlib
import random

import numpy as np
import torch
from deepspeed.accelerator import get_accelerator
from deepspeed.runtime.activation_checkpointing import checkpointing as ds_checkpointing

_TP_STREAM = ds_checkpointing._MODEL_PARALLEL_RNG_TRACKER_NAME


def seed_everything(seed: int, tp_rank: int, pp_rank: int = 0) -> None:
    """Seed python, numpy, torch and the TP stream. Parameter init does not use these:
    it draws from per-parameter generators so it is independent of the layout."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    get_accelerator().manual_seed_all(seed)
    tracker = ds_checkpointing.get_cuda_rng_tracker()
    tracker.reset()
    tracker.add(_TP_STREAM, seed + 2718 + tp_rank + 100 * pp_rank)


def tensor_parallel_rng():
    """Context for randomness on TP-split activations (a no-op before seeding)."""
    tracker = ds_checkpointing.get_cuda_rng_tracker()
    if _TP_STREAM not in tracker.get_states():
        return contextlib.nullcontext()
    return tracker.fork(_TP_STREAM)


class RandomStreams:
    """Which stream a dropout draws from, by where its activations live (the two streams above)."""

    def __init__(self, tp, sequence_parallel: bool):
        self.tp, self.sequence_parallel = tp, sequence_parallel

    def split(self):
        """Context for activations split over TP (heads, sequence slices)."""
        return tensor_parallel_rng() if self.tp.size > 1 else contextlib.nullcontext()

    def region(self):
        """Context for activations in the sequence region (split only under SP)."""
        return self.split() if self.sequence_parallel else contextlib.nullcontext()


def recompute_in_backward(function, *args):
    """``function(*args)`` keeping only its inputs, run again in backward (DeepSpeed's checkpoint:
    it restores the RNG streams above, so dropout masks repeat, and partitions the kept inputs over
    TP when configured to). A floating input that needs no gradient (a frozen embedding's output
    under LoRA) is made to need one: the reentrant checkpoint back-propagates into the recomputed
    region only through inputs that do, so the adapters inside would get no gradient.

    Only the floating inputs (the activations) pass through the checkpoint; the rest (position ids,
    None) reach ``function`` as they are, the same objects in the recompute. DeepSpeed's backward
    hands the recompute detached copies of its tensor inputs, and a copy loses what the packer
    attached to the ids (their sample starts, ``attention_backends.sample_starts``): every recomputed
    layer then found them on the device again: a host sync each, and under --torch-compile a graph
    break in each recomputed layer."""
    if torch.is_grad_enabled():
        args = tuple(a.detach().requires_grad_() if torch.is_tensor(a) and a.is_floating_point() and not a.requires_grad
                     else a for a in args)
    activation = [torch.is_tensor(a) and a.is_floating_point() for a in args]
    if all(activation):
        return ds_checkpointing.checkpoint(function, *args)
    # the activations themselves are not held here: DeepSpeed may keep only a partition or a CPU copy of them
    others = [None if is_activation else a for a, is_activation in zip(args, activation)]

    def on_activations(*activations):
        given = iter(activations)
        return function(*(next(given) if is_activation else a for a, is_activation in zip(others, activation)))
    return ds_checkpointing.checkpoint(on_activations, *(a for a, is_activation in zip(args, activation) if is_activation))
