"""The loss contract, and what a loss needs from the layout (the loss reducer).

Every task's loss is a sum and a count. For its micro-batch a loss function computes ``sums``
[terms] (pretraining and SFT: one term, the token losses; DPO: two, the pair losses and RPO's
chosen-token losses), and its ``counts(labels)`` [terms] say what each sum is normalised by (the
tokens with a label, the pairs). Before a step the task adds up the counts of the step's
micro-batches and reduces them over DP x CP, once (``global_counts``), so that every micro-batch
of the step, on every rank, divides by the same global count, once (``loss_scales``):

    loss of a micro-batch = sum over terms t of  sums_t x GAS x R / N_t

with N_t the step's global count and R the DP x CP ranks that reduce gradients. The factor GAS x R
is the one place where DeepSpeed's own arithmetic is cancelled: ``engine.backward`` divides each
micro-batch's loss by GAS (the pipeline engine too), and the gradient all-reduce averages over the
R ranks (to DeepSpeed a CP rank is one more data-parallel replica). What remains is the global
batch's sum over N: the same objective at any GAS, DP, CP, PP and micro-batch size. The logged loss
is the same value averaged as DeepSpeed averages (``step_loss``; the pipeline engine averages the
returned losses over micro-batches and R itself), i.e. the global sum over the global count.

Under CP a rank holds a slice of every row: a token sum is its slice's, counted by its slice's
tokens. A value computed from whole rows (a DPO pair loss, from log-probabilities summed over CP)
is held whole by every CP rank and counted by each, so N counts it CP times and each copy weighs
1/CP. A loss called on a micro-batch alone (no step scales with its labels: a test, a hand-made
forward) is normalised by its own counts: its mean.

MoE's auxiliary losses are no term of this sum: their gradient is seeded in backward
(``hybridlm.parallel.moe``); ``aux_loss_scale`` below states theirs.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .context import sum_over_context_parallel
from .fused_head import HeadLogits, fused_head_cross_entropy
from .state import SINGLE, GroupHandle
from .tensor_parallel import IGNORE_INDEX, vocab_parallel_cross_entropy


# ---------------------------------------------------------------- the contract: count once, divide once

def global_counts(local_counts: torch.Tensor, reduction: GroupHandle) -> torch.Tensor:
    """The step's counts: ``local_counts`` (this rank's, summed over the step's micro-batches) summed
    over the ranks that reduce gradients (DP x CP) in one all-reduce, left on the device (float64,
    exact for counts) so that the step does not wait for the host to read them."""
    counts = local_counts.to(torch.float64)
    if reduction.size > 1:
        dist.all_reduce(counts, group=reduction.group)
    return counts


def loss_scales(counts: torch.Tensor, reduction_size: int, accumulation_steps: int) -> torch.Tensor:
    """What each micro-batch's loss sums are multiplied by: GAS x R / N per term (float32), so that
    DeepSpeed's 1/GAS and its average over the R ranks leave sum / N (see the module docstring).
    This is the one place the loss is normalised."""
    factor = float(accumulation_steps * reduction_size)
    return (factor / counts.to(torch.float64).clamp_min(1.0)).to(torch.float32)


def scaled_loss(sums: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """A micro-batch's loss from its ``sums`` [terms] and the step's ``scales`` [terms] (for a
    micro-batch alone: ``loss_scales(its counts, 1, 1)``, its mean)."""
    return (sums * scales).sum()


def step_loss(returned: torch.Tensor, reduction: GroupHandle, accumulation_steps: int) -> torch.Tensor:
    """The step's loss from the sum of what its micro-batches' losses returned on this rank: their
    mean over the micro-batches and the R ranks (every rank gets it), the mean DeepSpeed takes of the
    gradients and the pipeline engine of the returned losses. By the scales above: global sum / N."""
    total = returned.detach().float().clone()
    if reduction.size > 1:
        dist.all_reduce(total, group=reduction.group)
    return total / (accumulation_steps * reduction.size)


def aux_loss_scale(accumulation_steps: int) -> float:
    """The gradient MoE's auxiliary losses get in backward. Each is a mean over its micro-batch's
    whole sequences, and their objective is its mean over the step's micro-batches and the R ranks:
    DeepSpeed's gradient average supplies the mean over R, as for the loss above, but the 1/GAS that
    ``engine.backward`` applies to the returned loss never reaches a gradient seeded in backward,
    so it is applied here."""
    return 1.0 / accumulation_steps


# ---------------------------------------------------------------- what a loss asks of the layout

class LossReducer:
    """Per-token losses of vocab-split logits (over TP) and sums over whole rows (over CP).
    ``sequence_parallel``: the final hidden states are a sequence slice per TP rank (the head gathers them)."""

    def __init__(self, tp: GroupHandle = SINGLE, cp: GroupHandle = SINGLE, sequence_parallel: bool = False):
        self.tp, self.cp = tp, cp
        self.sequence_parallel = sequence_parallel and tp.size > 1
        self.compiled_loss = None

    def cross_entropy(self, logits: torch.Tensor | HeadLogits, target: torch.Tensor, vocab_size: int | None = None) -> torch.Tensor:
        """Per-token loss of vocab-split logits; columns from ``vocab_size`` on (padding) take no part,
        and neither do IGNORE_INDEX targets (their loss is 0). ``HeadLogits``: computed with the head, chunk
        by chunk (``hybridlm.parallel.fused_head``)."""
        if isinstance(logits, HeadLogits):
            return fused_head_cross_entropy(logits, target, self.tp, vocab_size)
        if self.tp.size == 1 and self.compiled_loss is not None:
            return self.compiled_loss(logits if vocab_size is None else logits[..., :vocab_size], target)
        return vocab_parallel_cross_entropy(logits, target, self.tp, vocab_size)

    def compile(self, backend: str = "inductor") -> None:
        """With TP=1, compute the loss with a compiled cross-entropy: the fp32 upcast, softmax
        and its gradient fuse into a pass or two over the logits instead of materialising
        fp32 copies of a [tokens, vocab] tensor."""
        self.compiled_loss = torch.compile(_local_cross_entropy, backend=backend)

    def sequence_sum(self, partial: torch.Tensor) -> torch.Tensor:
        """A sum over whole rows from this rank's slice of them: under CP summed over the CP ranks,
        by an all-reduce whose backward is again one (``hybridlm.parallel.context``)."""
        return sum_over_context_parallel(partial, self.cp)


def _local_cross_entropy(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Per-token cross-entropy in fp32 of full-vocabulary logits [..., vocab] (TP=1)."""
    flat = logits.reshape(-1, logits.shape[-1]).float()
    return torch.nn.functional.cross_entropy(flat, target.reshape(-1), reduction="none",
                                             ignore_index=IGNORE_INDEX).view(target.shape)
