"""Tokens to their experts and back: sort-based permutation, the EP all-to-all, grouped GEMMs.

One micro-batch's assignments ([tokens, k] expert indices and weights) become rows sorted by
expert (one argsort and one gather: no loop over experts), the rows of other EP ranks'
experts travel by one uneven all-to-all each way, this rank's experts run as one grouped
GEMM per matrix, and the way back is the inverse permutation plus one weighted
``index_add`` into the tokens (accumulated in fp32).

Host synchronisations, the thing that stalls a GPU waiting on routing counts: with EP=1 and no
dropping there is none (the grouped GEMM takes its group offsets as a device tensor, and the
row count is tokens x k); with EP > 1 there is exactly one, the all-to-all's split sizes,
which ``torch.distributed.all_to_all_single`` needs on the host (``hybridlm.moe.split_sizes``
in a profile); with a capacity factor one more, the number of kept assignments.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.profiler import record_function

from .moe_routing import expert_counts
from .state import GroupHandle


class _AllToAll(torch.autograd.Function):
    """Uneven all-to-all over a group; backward sends the gradients back the same way."""

    @staticmethod
    def forward(ctx, x, output_splits, input_splits, group):
        ctx.group, ctx.splits = group, (output_splits, input_splits)
        out = x.new_empty((sum(output_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), output_splits, input_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        output_splits, input_splits = ctx.splits
        out = grad.new_empty((sum(input_splits), *grad.shape[1:]))
        dist.all_to_all_single(out, grad.contiguous(), input_splits, output_splits, group=ctx.group)
        return out, None, None, None


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward hands on a contiguous gradient: grouped_mm's backward
    rejects broadcast (stride-0) gradients."""

    @staticmethod
    def forward(ctx, x):
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad.contiguous()


def grouped_mm_usable(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether torch's grouped GEMM takes these operands (its CUDA kernel wants bf16 and rows of
    16-byte multiples; the CPU one any float type, though not inside torch.compile, whose shape
    check demands bf16 everywhere)."""
    aligned = x.shape[-1] * x.element_size() % 16 == 0 and weight.shape[1] * weight.element_size() % 16 == 0
    cpu = x.device.type == "cpu" and not torch.compiler.is_compiling()
    return aligned and hasattr(F, "grouped_mm") and (cpu or x.dtype == torch.bfloat16)


def expert_matmul(x: torch.Tensor, weight: torch.Tensor, counts, grouped: bool) -> torch.Tensor:
    """Rows of ``x`` grouped by expert (``counts[e]`` rows each; a device tensor or a list) times
    ``weight[e]^T``: one grouped GEMM where torch offers it for these shapes, else a loop over experts."""
    if grouped and grouped_mm_usable(x, weight):
        counts = torch.as_tensor(counts, device=x.device)
        offsets = counts.cumsum(0).to(torch.int32)
        return _ContiguousGrad.apply(F.grouped_mm(x.contiguous(), weight.transpose(1, 2), offs=offsets))
    return _expert_loop(x, weight, counts)


@torch._disable_dynamo
def _expert_loop(x: torch.Tensor, weight: torch.Tensor, counts) -> torch.Tensor:
    """One matmul per expert, always eager. Under torch.compile the row counts (data, read on the host) would become
    the graph's shapes: dynamo recompiled this loop for each new split of the rows (about once per layer and step,
    each recompile costing more than the loop's matmuls gain from a graph). Eager, it runs the same aten ops."""
    sizes = counts.tolist() if torch.is_tensor(counts) else list(counts)
    return torch.cat([rows @ w.t() for rows, w in zip(x.split(sizes), weight)])


def inverse_permutation(order: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))


def permute(index: torch.Tensor, weights: torch.Tensor, keep: torch.Tensor | None, num_experts: int):
    """Assignments sorted by expert: (token of each row, its weight, rows per expert [experts]).
    Dropped assignments (``keep`` False) are left out."""
    expert = index.reshape(-1)
    token = torch.arange(expert.numel(), device=expert.device) // index.shape[1]
    weight = weights.reshape(-1)
    if keep is not None:
        kept = keep.reshape(-1).nonzero().squeeze(1)  # a host sync: the number kept shapes the rows
        expert, token, weight = expert[kept], token[kept], weight[kept]
    order = torch.argsort(expert, stable=True)
    return token[order], weight[order], expert_counts(expert, num_experts)


def unpermute(rows: torch.Tensor, token: torch.Tensor, weight: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """Weighted sum of each token's expert outputs, accumulated in fp32, in the rows' dtype."""
    combined = torch.zeros((num_tokens, rows.shape[-1]), dtype=torch.float32, device=rows.device)
    return combined.index_add(0, token, rows.float() * weight.unsqueeze(-1)).to(rows.dtype)


def exchange(rows: torch.Tensor, counts: torch.Tensor, ep: GroupHandle, local_experts: int,
             experts: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """Rows sorted by global expert (``counts`` each) -> ``experts(rows, counts)`` on the EP rank
    holding them, grouped by local expert -> back to the sender, in the sender's order."""
    if ep.size == 1:
        return experts(rows, counts)
    received = torch.empty_like(counts)
    dist.all_to_all_single(received, counts, group=ep.group)  # [source rank, local expert] counts
    received = received.view(ep.size, local_experts)
    with record_function("hybridlm.moe.split_sizes"):  # the one host sync of an EP step
        splits = torch.cat([counts.view(ep.size, local_experts).sum(1), received.sum(1)]).tolist()
    send, recv = splits[:ep.size], splits[ep.size:]
    rows = _AllToAll.apply(rows, recv, send, ep.group)
    segment = torch.repeat_interleave(torch.arange(ep.size * local_experts, device=rows.device), received.reshape(-1),
                                      output_size=sum(recv))
    # (source, expert) order -> (expert, source) order, so each local expert's rows are contiguous
    regroup = torch.argsort((segment % local_experts) * ep.size + segment // local_experts, stable=True)
    out = experts(rows[regroup], received.sum(0))
    return _AllToAll.apply(out[inverse_permutation(regroup)], send, recv, ep.group)
