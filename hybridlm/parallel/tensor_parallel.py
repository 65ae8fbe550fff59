"""Megatron-style tensor-parallel layers and the vocab-parallel cross-entropy.

Each layer holds its rank's shard and tags the parameter with a ``Sharding`` that says how
the shard relates to the full (single-process) tensor. That one tag lets the same code
initialise any layout from the seed (``hybridlm.model.init``), load a full state dict into
any layout, and gather a layout back into a full state dict, so "the same seed gives the
same model at any TP" holds by construction and the correctness oracle can compare
layouts weight for weight.

A weight made of stacked sub-matrices (QKV, SwiGLU's gate and up) is split block by block:
each TP rank holds the same slice of every block, so the full tensor never depends on TP.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from .sequence import eager_crossing, gather_from_sequence, reduce_scatter_to_sequence, sum_grad_over_tp
from .state import GroupHandle

IGNORE_INDEX = -100  # a label that takes no part in the loss (PyTorch's and Hugging Face's convention)


@dataclass(frozen=True)
class Sharding:
    """How a full tensor is split over a group: along ``dim``, each of ``blocks`` split evenly.
    Parameters carry one for TP (``tp_sharding``); stacked expert weights also carry one
    for EP (``ep_sharding``: dim 0, one block of all experts)."""
    dim: int
    blocks: tuple[int, ...]

    def full_shape(self, local_shape: Sequence[int], group_size: int) -> tuple[int, ...]:
        shape = list(local_shape)
        shape[self.dim] = sum(self.blocks)
        return tuple(shape)

    def shard(self, full: torch.Tensor, rank: int, size: int) -> torch.Tensor:
        pieces = []
        for block in torch.split(full, list(self.blocks), dim=self.dim):
            pieces.append(torch.chunk(block, size, dim=self.dim)[rank])
        return torch.cat(pieces, dim=self.dim)

    def unshard(self, shards: Sequence[torch.Tensor]) -> torch.Tensor:
        size = len(shards)
        local_blocks = [b // size for b in self.blocks]
        per_rank = [torch.split(s, local_blocks, dim=self.dim) for s in shards]
        return torch.cat([torch.cat([r[i] for r in per_rank], dim=self.dim) for i in range(len(self.blocks))], dim=self.dim)


def tag_parameter(param: nn.Parameter, sharding: Sharding | None, init_std: float | None = None, init_value: float | None = None):
    """Attach what initialisation and checkpoint conversion need to know about a parameter."""
    param.tp_sharding = sharding
    if sharding is not None:
        param.tensor_model_parallel = True  # DeepSpeed's grad-norm counts it on every TP rank
        param.partition_dim = sharding.dim
    param.init_std = init_std
    param.init_value = init_value
    return param


class _CopyToTensorParallel(torch.autograd.Function):
    """Identity forward; backward sums the input gradient over TP (each rank used a slice of the weights)."""

    @staticmethod
    def forward(ctx, x, tp):
        ctx.tp = tp
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.tp.group)
        return grad, None


class _ReduceFromTensorParallel(torch.autograd.Function):
    """Sums partial outputs over TP; backward is the identity."""

    @staticmethod
    def forward(ctx, x, tp):
        x = x.contiguous()
        dist.all_reduce(x, group=tp.group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


_copy = eager_crossing(_CopyToTensorParallel)
_reduce = eager_crossing(_ReduceFromTensorParallel)


def copy_to_tensor_parallel(x, tp: GroupHandle):
    return x if tp.size == 1 else _copy(x, tp)


def reduce_from_tensor_parallel(x, tp: GroupHandle):
    return x if tp.size == 1 else _reduce(x, tp)


class ColumnParallelLinear(nn.Module):
    """y = x W^T with W's output rows split over TP; the output stays split.

    ``local_matmul`` (a factory taking the weight and bias) swaps the rank-local matmul for
    another library's (Transformer Engine's, for FP8; a 4-bit base's, ``hybridlm.parallel.quantized``,
    set after construction) while the communication stays here.
    ``input_norm`` with ``local_norm_matmul`` (a factory taking the norm, weight and bias)
    fuses the norm that precedes this linear into its GEMM (TE's LayerNormLinear); then
    ``owns_norm`` is True and the caller passes the un-normalised input. Without sequence
    parallelism only: under SP the all-gather comes between norm and GEMM.

    ``output_sizes`` lists stacked blocks (e.g. [q, k, v]); ``local_sizes`` says how wide
    each block is on this rank, so a caller can split the output without knowing TP.
    With sequence parallelism the input arrives sequence-sharded and is all-gathered.
    """

    def __init__(self, input_size: int, output_sizes: Sequence[int], tp: GroupHandle, *, bias: bool,
                 sequence_parallel: bool, init_std: float, device=None, dtype=None, local_matmul=None,
                 input_norm: nn.Module | None = None, local_norm_matmul=None):
        super().__init__()
        for size in output_sizes:
            if size % tp.size:
                raise ValueError(f"output block {size} is not divisible by TP {tp.size}")
        self.tp, self.sequence_parallel = tp, sequence_parallel
        self.output_sizes = tuple(output_sizes)
        self.local_sizes = tuple(s // tp.size for s in output_sizes)
        sharding = Sharding(0, self.output_sizes)
        self.weight = tag_parameter(nn.Parameter(torch.empty(sum(self.local_sizes), input_size, device=device, dtype=dtype)), sharding, init_std)
        self.bias = tag_parameter(nn.Parameter(torch.empty(sum(self.local_sizes), device=device, dtype=dtype)), sharding, None, 0.0) if bias else None
        self.owns_norm = input_norm is not None and local_norm_matmul is not None and not sequence_parallel
        if self.owns_norm:
            self.local_matmul = local_norm_matmul(input_norm, self.weight, self.bias)
            for param in input_norm.parameters():
                # each TP rank back-propagates only its output columns into the fused norm,
                # so the norm's gradients are partial sums (the input's are summed by the copy)
                sum_grad_over_tp(param, tp)
        else:
            self.local_matmul = local_matmul(self.weight, self.bias) if local_matmul else None
        self.lora = None  # a LoRA adapter (hybridlm.parallel.lora.add_adapters): its term is added to the output

    def forward(self, x):
        if self.local_matmul is not None:
            y = self.local_matmul(gather_from_sequence(x, self.tp) if self.sequence_parallel else copy_to_tensor_parallel(x, self.tp))
        else:
            y = column_parallel_matmul(x, self.weight, self.bias, self.tp, self.sequence_parallel)
        return y + self.lora(x) if self.lora is not None and self.lora.enabled else y


def column_parallel_matmul(x, weight, bias, tp: GroupHandle, sequence_parallel: bool):
    x = gather_from_sequence(x, tp) if sequence_parallel else copy_to_tensor_parallel(x, tp)
    return rows_linear(x, weight, bias)


def rows_linear(x, weight, bias=None):
    """``F.linear`` on the rows of ``x`` laid flat, as one GEMM whatever ``x``'s layout.

    torch's matmul folds a 3-D input into a matrix only where that is a view or the weight needs a
    gradient. A frozen weight (LoRA's base, a 4-bit one dequantized) beside an input whose rows are
    not one view (batch-major memory under [s, b, h], as compiled graphs may hand it on) took a
    batched matmul against the broadcast weight instead: half of a compiled, recomputed QLoRA step
    (hybridlm.parallel.quantized). A contiguous input costs nothing here: the reshape is a view."""
    out = F.linear(x.reshape(-1, x.shape[-1]), weight, bias)
    return out.view(*x.shape[:-1], out.shape[-1])


class RowParallelLinear(nn.Module):
    """y = x W^T with W's input columns split over TP; partial outputs are summed
    (all-reduce), or summed and sequence-scattered (reduce-scatter) under SP."""

    def __init__(self, input_size: int, output_size: int, tp: GroupHandle, *, bias: bool,
                 sequence_parallel: bool, init_std: float, device=None, dtype=None, local_matmul=None):
        super().__init__()
        if input_size % tp.size:
            raise ValueError(f"input size {input_size} is not divisible by TP {tp.size}")
        self.tp, self.sequence_parallel = tp, sequence_parallel
        self.weight = tag_parameter(nn.Parameter(torch.empty(output_size, input_size // tp.size, device=device, dtype=dtype)),
                           Sharding(1, (input_size,)), init_std)
        self.bias = None
        if bias:
            self.bias = tag_parameter(nn.Parameter(torch.empty(output_size, device=device, dtype=dtype)), None, None, 0.0)
            if sequence_parallel:
                sum_grad_over_tp(self.bias, tp)
        self.local_matmul = local_matmul(self.weight, None) if local_matmul else None
        self.lora = None  # a LoRA adapter (hybridlm.parallel.lora.add_adapters): its term is added to the output

    def forward(self, x):
        y = self.local_matmul(x) if self.local_matmul is not None else rows_linear(x, self.weight)
        y = reduce_scatter_to_sequence(y, self.tp) if self.sequence_parallel else reduce_from_tensor_parallel(y, self.tp)
        if self.lora is not None and self.lora.enabled:
            y = y + self.lora(x)
        return y + self.bias if self.bias is not None else y


class VocabParallelEmbedding(nn.Module):
    """Embedding table with its rows (the vocabulary) split over TP; out-of-shard tokens
    contribute zeros and an all-reduce assembles the full embedding."""

    def __init__(self, num_embeddings: int, dim: int, tp: GroupHandle, *, init_std: float, device=None, dtype=None):
        super().__init__()
        if num_embeddings % tp.size:
            raise ValueError(f"vocabulary {num_embeddings} is not divisible by TP {tp.size}")
        self.tp = tp
        self.per_rank = num_embeddings // tp.size
        self.start = tp.rank * self.per_rank
        self.weight = tag_parameter(nn.Parameter(torch.empty(self.per_rank, dim, device=device, dtype=dtype)),
                           Sharding(0, (num_embeddings,)), init_std)

    def forward(self, tokens):
        if self.tp.size == 1:
            return F.embedding(tokens, self.weight)
        local = tokens - self.start
        outside = (local < 0) | (local >= self.per_rank)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_from_tensor_parallel(out, self.tp)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Cross-entropy over logits whose vocabulary is split over TP, without gathering them:
    three all-reduces of [tokens]-sized tensors (max, target logit, sum of exponentials).

    Columns at or beyond ``vocab_size`` are vocabulary padding (a multiple of 128 x TP, so
    its amount depends on TP): they are left out of the softmax, so the loss and gradients
    are those of the unpadded model at every TP; their gradient is zero. A target equal to
    ``IGNORE_INDEX`` (a prompt or padding position in fine-tuning) gets loss 0 and no gradient.

    Memory: the logits [tokens, vocab] are the step's largest tensors (GRPO's 4,096 completion
    tokens x 151,936 columns: 1.2 GB in bf16). The statistics are computed in fp32 (or wider) over
    chunks of ``_CHUNK_ELEMENTS``, and only the logits and each token's max and sum of exponentials are
    kept for backward, which recomputes the softmax chunk by chunk into a gradient of the logits' dtype:
    no fp32 copy of the whole logits exists (an earlier version kept an fp32 softmax: 4 bytes an entry
    beside the logits' 2 in bf16). The arithmetic is the same as that version's, operation for operation."""

    @staticmethod
    def forward(ctx, logits, target, tp, vocab_size):
        per_rank = logits.shape[-1]
        compute = torch.promote_types(logits.dtype, torch.float32)
        flat = logits.reshape(-1, per_rank)
        valid, local_target, outside, ignored = vocab_shard_targets(target.reshape(-1), tp.rank, per_rank, vocab_size)
        local_max = torch.full(local_target.shape, float("-inf"), device=logits.device, dtype=compute)
        target_logit = torch.zeros(local_target.shape, device=logits.device, dtype=compute)
        for rows in row_chunks(flat.shape[0], valid):  # a rank holding only padding has nothing to visit
            part = flat[rows, :valid].to(compute)
            local_max[rows] = part.max(dim=-1).values
            target_logit[rows] = part.gather(-1, local_target[rows].unsqueeze(-1)).squeeze(-1)
        target_logit.masked_fill_(outside, 0.0)  # under TP only the rank owning the target keeps it
        if tp.size > 1:
            dist.all_reduce(local_max, op=dist.ReduceOp.MAX, group=tp.group)
        sum_exp = torch.zeros_like(local_max)
        for rows in row_chunks(flat.shape[0], valid):
            sum_exp[rows] = (flat[rows, :valid].to(compute) - local_max[rows].unsqueeze(-1)).exp_().sum(dim=-1)
        if tp.size > 1:
            both = torch.stack([target_logit, sum_exp])
            dist.all_reduce(both, group=tp.group)
            target_logit, sum_exp = both[0], both[1]
        shifted_target = target_logit - local_max  # the fp32 subtraction that shifting the logits would have made
        loss = (sum_exp.log() - shifted_target).masked_fill_(ignored, 0.0)
        ctx.valid = valid
        ctx.save_for_backward(logits, local_max, sum_exp, local_target, outside, ignored)
        return loss.view(logits.shape[:-1])

    @staticmethod
    def backward(ctx, grad_loss):
        logits, local_max, sum_exp, local_target, outside, ignored = ctx.saved_tensors
        valid, per_rank = ctx.valid, logits.shape[-1]
        flat = logits.reshape(-1, per_rank)
        grad_loss = grad_loss.reshape(-1).masked_fill(ignored, 0.0)
        grad = torch.empty_like(flat)
        grad[:, valid:] = 0.0
        for rows in row_chunks(flat.shape[0], valid):  # the softmax, computed as the forward computed it
            part = (flat[rows, :valid].to(local_max.dtype) - local_max[rows].unsqueeze(-1)).exp_().div_(sum_exp[rows].unsqueeze(-1))
            part.scatter_add_(-1, local_target[rows].unsqueeze(-1), -(~outside[rows]).to(part.dtype).unsqueeze(-1))
            grad[rows, :valid] = part.mul_(grad_loss[rows].to(part.dtype).unsqueeze(-1))
        return grad.view(logits.shape), None, None, None


def vocab_shard_targets(target: torch.Tensor, rank: int, per_rank: int, vocab_size: int):
    """Where flat full-vocabulary targets fall in TP rank ``rank``'s ``per_rank`` columns: (the rank's real columns,
    each target's column here (0 where it is not here), not here or ignored, ignored)."""
    start = rank * per_rank
    valid = min(per_rank, max(0, vocab_size - start))  # columns from vocab_size on are padding
    ignored = target == IGNORE_INDEX
    local_target = target - start
    outside = (local_target < 0) | (local_target >= valid) | ignored
    return valid, local_target.masked_fill(outside, 0), outside, ignored


_CHUNK_ELEMENTS = 1 << 26  # entries of one fp32 chunk of the cross-entropy (256 MiB)


def row_chunks(rows: int, columns: int):
    """Slices of rows covering ``rows`` in chunks of about ``_CHUNK_ELEMENTS`` entries (none when no column): the
    cross-entropies' unit of fp32 work (also ``fused_head``'s)."""
    if columns == 0:
        return
    step = max(1, _CHUNK_ELEMENTS // columns)
    for first in range(0, rows, step):
        yield slice(first, min(first + step, rows))


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, tp: GroupHandle,
                                 vocab_size: int | None = None) -> torch.Tensor:
    """Per-token loss (fp32 or wider) for logits [..., padded vocab/TP] and targets [...] in
    full-vocabulary ids (``IGNORE_INDEX``: loss 0); ``vocab_size`` (default: all columns) leaves the padding out."""
    if vocab_size is None:
        vocab_size = logits.shape[-1] * tp.size
    return _VocabParallelCrossEntropy.apply(logits, target, tp, vocab_size)


def scaled_init_std(std: float, num_layers: int) -> float:
    """Megatron's output-projection init: residual branches summed over 2L sub-layers keep unit scale."""
    return std / math.sqrt(2.0 * num_layers)
