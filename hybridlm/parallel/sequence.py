"""Megatron sequence parallelism: the autograd functions that move activations between
the sequence-sharded region (norms, dropout, residual adds) and the tensor-parallel region
(the matmuls).

Activations are [sequence, batch, hidden]; the sequence dimension (0) is the one split,
so every shard is a contiguous block and needs no copy before a collective. Each
function's backward is the collective's adjoint: all-gather <-> reduce-scatter,
split <-> all-gather.

Parameters used only inside the sequence-sharded region (norm weights, row-parallel
biases) are replicated over TP but see only their rank's tokens, so their gradients are
partial sums: ``sum_grad_over_tp`` registers the all-reduce that completes them.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .state import GroupHandle

_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def all_gather_dim0(x: torch.Tensor, tp: GroupHandle) -> torch.Tensor:
    if tp.size == 1:
        return x
    x = x.contiguous()
    out = torch.empty((x.shape[0] * tp.size, *x.shape[1:]), dtype=x.dtype, device=x.device)
    _all_gather(out, x, group=tp.group)
    return out


def reduce_scatter_dim0(x: torch.Tensor, tp: GroupHandle) -> torch.Tensor:
    if tp.size == 1:
        return x
    if x.shape[0] % tp.size:
        raise ValueError(f"sequence length {x.shape[0]} is not divisible by TP {tp.size}")
    x = x.contiguous()
    out = torch.empty((x.shape[0] // tp.size, *x.shape[1:]), dtype=x.dtype, device=x.device)
    _reduce_scatter(out, x, group=tp.group)
    return out


def split_dim0(x: torch.Tensor, tp: GroupHandle) -> torch.Tensor:
    if tp.size == 1:
        return x
    chunk = x.shape[0] // tp.size
    return x[tp.rank * chunk:(tp.rank + 1) * chunk].contiguous()


class _ScatterToSequence(torch.autograd.Function):
    """Replicated full sequence -> this rank's slice (forward split, backward all-gather)."""

    @staticmethod
    def forward(ctx, x, tp):
        ctx.tp = tp
        return split_dim0(x, tp)

    @staticmethod
    def backward(ctx, grad):
        return all_gather_dim0(grad, ctx.tp), None


class _GatherFromSequence(torch.autograd.Function):
    """Sequence slices -> the full sequence for a column-parallel matmul (backward reduce-scatter)."""

    @staticmethod
    def forward(ctx, x, tp):
        ctx.tp = tp
        return all_gather_dim0(x, tp)

    @staticmethod
    def backward(ctx, grad):
        return reduce_scatter_dim0(grad, ctx.tp), None


class _ReduceScatterToSequence(torch.autograd.Function):
    """Partial sums of a row-parallel matmul -> this rank's summed slice (backward all-gather)."""

    @staticmethod
    def forward(ctx, x, tp):
        ctx.tp = tp
        return reduce_scatter_dim0(x, tp)

    @staticmethod
    def backward(ctx, grad):
        return all_gather_dim0(grad, ctx.tp), None


def eager_crossing(function: type[torch.autograd.Function]):
    """``function.apply(x, tp)``, always run outside compiled graphs. Under ``--torch-compile`` dynamo would trace
    the in-place c10d calls of these Functions' forward and backward into functional collectives; on NCCL the
    compiled backward then gave wrong gradients (tests/test_gpu.py) that gloo, which completes every collective before
    returning, never showed. Disabling dynamo on them breaks the graph at each crossing, so each collective runs exactly
    as in eager mode and the code between them still compiles. ``torch._disable_dynamo`` is ``torch.compiler.disable``
    importing torch._dynamo at the first call instead of at import: ~1.5 s of CPU in every process that imports the
    model, a refused run's ranks too. The public functions return early with one rank, so TP=1 graphs stay whole."""
    @torch._disable_dynamo
    def apply(x: torch.Tensor, tp: GroupHandle) -> torch.Tensor:
        return function.apply(x, tp)
    return apply


_scatter_fn = eager_crossing(_ScatterToSequence)
_gather_fn = eager_crossing(_GatherFromSequence)
_reduce_scatter_fn = eager_crossing(_ReduceScatterToSequence)


def scatter_to_sequence(x: torch.Tensor, tp: GroupHandle) -> torch.Tensor:
    return x if tp.size == 1 else _scatter_fn(x, tp)


def gather_from_sequence(x: torch.Tensor, tp: GroupHandle) -> torch.Tensor:
    return x if tp.size == 1 else _gather_fn(x, tp)


def reduce_scatter_to_sequence(x: torch.Tensor, tp: GroupHandle) -> torch.Tensor:
    return x if tp.size == 1 else _reduce_scatter_fn(x, tp)


def sum_grad_over_tp(param: torch.nn.Parameter, tp: GroupHandle) -> None:
    """Make ``param``'s gradient the sum over TP ranks, each of which saw only its tokens."""
    if tp.size == 1:
        return

    def all_reduce(grad):
        grad = grad.clone()
        dist.all_reduce(grad, group=tp.group)
        return grad

    param.register_hook(all_reduce)
    param.sequence_parallel = True
