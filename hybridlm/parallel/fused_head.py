"""The output head and its cross-entropy in one pass over chunks of rows: the logits are never whole.

A loss over a large vocabulary holds the step's largest tensors at the top of backward: the logits
[tokens, vocab/TP] and their gradient, each 1.2 GB in bf16 for GRPO's 4,096 completion tokens of a
151,936-word Qwen2 (``_VocabParallelCrossEntropy`` already keeps no fp32 copy beside them). Here the head's
GEMM runs inside the loss, a chunk of rows at a time: forward keeps each token's log-sum-exp, backward
recomputes a chunk's logits, turns them into that chunk's gradient and multiplies it into the hidden
states' and the weight's gradients at once. What stays is the hidden states (kept anyway) and a chunk.

The arithmetic per chunk is the unfused path's: the logits in the hidden states' dtype (divided there by a
sampling temperature, as ``logits / T`` is), the statistics in fp32. Each TP rank finds its own max and sum
of exponentials in one pass (no second GEMM), and the ranks combine them: the global max M of the ranks'
maxima m_r, and the sum of s_r exp(m_r - M). The weight's gradient is summed over chunks in fp32.

``HeadLogits`` is what the head hands a loss that asks for it (``fused_head = True``): the hidden states
after the head's TP crossing (the sequence-parallel gather, or the identity whose backward sums over TP)
and this rank's vocabulary rows. ``LossReducer.cross_entropy`` takes it where it takes logits.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .state import GroupHandle
from .tensor_parallel import row_chunks, vocab_shard_targets


@dataclass(frozen=True)
class HeadLogits:
    """Logits not yet computed: ``hidden`` [..., h] (after the head's TP crossing) times ``weight``
    [vocab/TP, h] transposed, divided by ``divisor``."""

    hidden: torch.Tensor
    weight: torch.Tensor
    divisor: float = 1.0

    def __truediv__(self, temperature: float) -> "HeadLogits":
        return replace(self, divisor=self.divisor * temperature)


def _logits(hidden: torch.Tensor, weight: torch.Tensor, divisor: float) -> torch.Tensor:
    logits = F.linear(hidden, weight)
    return logits if divisor == 1.0 else logits / divisor


class _FusedHeadCrossEntropy(torch.autograd.Function):
    """Per-row loss of target ids (full-vocabulary, ``IGNORE_INDEX``: loss 0 and no gradient) under the logits
    ``hidden @ weight[:valid].T / divisor`` split over TP by vocabulary rows; columns at or beyond ``vocab_size``
    (padding) take no part."""

    @staticmethod
    def forward(ctx, hidden, weight, target, tp, vocab_size, divisor):
        per_rank, width = weight.shape
        compute = torch.promote_types(hidden.dtype, torch.float32)
        flat = hidden.reshape(-1, width)
        valid, local_target, outside, ignored = vocab_shard_targets(target.reshape(-1), tp.rank, per_rank, vocab_size)
        local_max = torch.full(local_target.shape, float("-inf"), device=hidden.device, dtype=compute)
        local_sum = torch.zeros(local_target.shape, device=hidden.device, dtype=compute)
        target_logit = torch.zeros(local_target.shape, device=hidden.device, dtype=compute)
        for rows in row_chunks(flat.shape[0], valid):  # a rank holding only padding has nothing to visit
            part = _logits(flat[rows], weight[:valid], divisor).to(compute)
            local_max[rows] = part.max(dim=-1).values
            target_logit[rows] = part.gather(-1, local_target[rows].unsqueeze(-1)).squeeze(-1)
            local_sum[rows] = part.sub_(local_max[rows].unsqueeze(-1)).exp_().sum(dim=-1)
        target_logit.masked_fill_(outside, 0.0)
        if tp.size > 1:
            global_max = local_max.clone()
            dist.all_reduce(global_max, op=dist.ReduceOp.MAX, group=tp.group)
            both = torch.stack([target_logit, local_sum * (local_max - global_max).exp()])  # a rank of padding adds 0
            dist.all_reduce(both, group=tp.group)
            target_logit, sum_exp, local_max = both[0], both[1], global_max
        else:
            sum_exp = local_sum
        loss = (sum_exp.log() - (target_logit - local_max)).masked_fill_(ignored, 0.0)
        ctx.valid, ctx.divisor = valid, divisor
        ctx.save_for_backward(hidden, weight, local_max, sum_exp, local_target, outside, ignored)
        return loss.view(hidden.shape[:-1])

    @staticmethod
    def backward(ctx, grad_loss):
        hidden, weight, local_max, sum_exp, local_target, outside, ignored = ctx.saved_tensors
        valid, divisor = ctx.valid, ctx.divisor
        flat = hidden.reshape(-1, hidden.shape[-1])
        grad_loss = grad_loss.reshape(-1).masked_fill(ignored, 0.0)
        grad_hidden = torch.zeros_like(flat)
        grad_weight = torch.zeros(weight.shape, device=weight.device, dtype=torch.promote_types(weight.dtype, torch.float32))
        rows_weight = weight[:valid]
        for rows in row_chunks(flat.shape[0], valid):  # the softmax as forward computed it, then the head's two GEMMs
            part = _logits(flat[rows], rows_weight, divisor).to(local_max.dtype)
            part.sub_(local_max[rows].unsqueeze(-1)).exp_().div_(sum_exp[rows].unsqueeze(-1))
            part.scatter_add_(-1, local_target[rows].unsqueeze(-1), -(~outside[rows]).to(part.dtype).unsqueeze(-1))
            part.mul_(grad_loss[rows].to(part.dtype).unsqueeze(-1))
            grad_logits = part.to(hidden.dtype)
            if divisor != 1.0:  # d(l / T) = dl / T, as autograd divides the logits' gradient
                grad_logits = grad_logits / divisor
            grad_hidden[rows] = grad_logits @ rows_weight
            grad_weight[:valid] += (grad_logits.t() @ flat[rows]).to(grad_weight.dtype)
        return grad_hidden.view(hidden.shape), grad_weight.to(weight.dtype), None, None, None, None


def fused_head_cross_entropy(logits: HeadLogits, target: torch.Tensor, tp: GroupHandle, vocab_size: int | None = None) -> torch.Tensor:
    """Per-token loss (fp32 or wider) of ``logits`` against ``target`` [...] (the hidden states' leading shape)."""
    if vocab_size is None:
        vocab_size = logits.weight.shape[0] * tp.size
    return _FusedHeadCrossEntropy.apply(logits.hidden, logits.weight, target, tp, vocab_size, logits.divisor)
