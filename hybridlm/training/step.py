"""One global batch through the engine: the step loop that training, evaluation and DPO's
reference pass share.

The micro-batches come as the task made them (``tasks.py``: labels with the step's loss scales),
so a step's loss is the same number whether it trains or evaluates, on one process or many: each
micro-batch's loss function returns its share of the global objective (``hybridlm.parallel.loss``),
and the step's loss is their mean over the micro-batches and the ranks that reduce gradients. With
PP > 1 DeepSpeed's pipeline schedule runs the micro-batches and takes that mean itself.
"""
from __future__ import annotations

from typing import Iterator

import torch
from torch.profiler import record_function

from ..parallel.loss import step_loss


def run_step(run, micro_batches: Iterator, *, train: bool) -> torch.Tensor:
    """Forward every micro-batch of one step (``micro_batches``: the step's, as the engine takes
    them), in training also backward and the optimizer step (DeepSpeed applies it at the last
    micro-batch). Returns the step's loss on every rank."""
    engine, steps = run.engine, run.cfg.gradient_accumulation_steps
    if run.is_pipeline:
        return engine.train_batch(micro_batches) if train else engine.eval_batch(micro_batches)
    if not train:
        engine.eval()
    elif run.main_grads is not None:
        run.main_grads.zero_()
    returned = torch.zeros((), device=engine.device)
    for micro in range(steps):
        with record_function("hybridlm.next_batch"):  # names in a --profile-step-range trace
            inputs, labels = next(micro_batches)
        if train:
            run.phase.first = micro == 0
        with record_function("hybridlm.forward"):
            loss = engine(inputs, labels)
        if train:
            with record_function("hybridlm.backward"):
                engine.backward(loss)
            release_cached_memory(run, 2)
            with record_function("hybridlm.step"):
                engine.step()
        returned += loss.detach().float()
    if train:
        run.phase.first = None
    else:
        engine.train()
    return step_loss(returned, run.ps.grad_reduction, steps)


def release_cached_memory(run, level: int) -> None:
    """--empty-unused-memory-level: give the CUDA caching allocator's free blocks back at ``level``."""
    if run.cfg.train.empty_unused_memory_level >= level and torch.cuda.is_available():
        torch.cuda.empty_cache()
