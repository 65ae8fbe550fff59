"""The layer factory the model is built with: tensor-parallel layers for a TP group.

The blocks in ``hybridlm.model.gpt`` ask this object for "a linear whose output is
split", "a linear whose input is split", "an embedding", "a norm", "routed experts",
and for the points where activations enter and leave the sequence-sharded region. They never ask whether
they are tensor- or sequence-parallel: with TP=1 the same layers degrade to plain
matmuls with no communication.
"""
from __future__ import annotations

import contextlib
from typing import Callable, Sequence

import torch
from torch import nn

from ..ops import Kernels, reference_kernels
from .context import ContextParallelAttention
from .loss import LossReducer
from .moe import MoELayer
from .random import tensor_parallel_rng
from .sequence import scatter_to_sequence, sum_grad_over_tp
from .state import SINGLE, GroupHandle
from .tensor_parallel import (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding,
                              column_parallel_matmul, copy_to_tensor_parallel, reduce_from_tensor_parallel, tag_parameter)


class _BetweenTPCrossings:
    """x -> reduce over TP(block(copy to TP(x))): a rank-local block between the two TP crossings.
    An object rather than a closure, so that ``block`` stays reachable (the FP8 bookkeeping of
    CUDA graph capture looks for the TE modules a layer calls)."""

    def __init__(self, block: Callable, tp: GroupHandle):
        self.block, self.tp = block, tp

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return reduce_from_tensor_parallel(self.block(copy_to_tensor_parallel(x, self.tp)), self.tp)


class ParallelPlan:
    def __init__(self, tp: GroupHandle = SINGLE, *, ep: GroupHandle = SINGLE, expert_dp: GroupHandle = SINGLE,
                 cp: GroupHandle = SINGLE, cp_comm_type: str = "p2p", grad_reduction: GroupHandle = SINGLE,
                 sequence_parallel: bool = False, device=None, dtype=None,
                 local_matmul: Callable | None = None, local_norm_matmul: Callable | None = None,
                 local_norm_mlp: Callable | None = None,
                 layer_context: Callable = contextlib.nullcontext, kernels: Kernels | None = None):
        """``local_matmul``: a factory (weight, bias) -> callable replacing the linears' rank-local
        GEMM (Transformer Engine's); ``local_norm_matmul``: a factory (norm, weight, bias) fusing a
        norm into the column linear after it (TE's LayerNormLinear); ``local_norm_mlp``: a factory
        (norm, fc1 weight, fc2 weight, activation) for a whole norm + MLP block on this rank's
        shards (TE's LayerNormMLP); ``layer_context``: what each transformer layer's forward
        runs under (FP8 autocast); ``kernels``: the RMSNorm / RoPE / SwiGLU implementations
        (``hybridlm.ops.select_kernels``; default: the PyTorch definitions). ``cp``: the context-parallel
        group, which splits every sample's sequence (``hybridlm.parallel.context``), and ``cp_comm_type``
        how attention crosses it; ``grad_reduction``: DP x CP (``ParallelState``), over which MoE sums
        what the whole data-parallel batch routed."""
        self.tp, self.ep, self.expert_dp = tp, ep, expert_dp
        self.cp, self.cp_comm_type, self.grad_reduction = cp, cp_comm_type, grad_reduction
        self.sequence_parallel = sequence_parallel and tp.size > 1
        self.device, self.dtype = device, dtype
        self.local_matmul, self.local_norm_matmul, self.layer_context = local_matmul, local_norm_matmul, layer_context
        self.local_norm_mlp = local_norm_mlp
        self.kernels = kernels or reference_kernels()
        self.loss = LossReducer(tp, cp, self.sequence_parallel)  # what the model's loss asks of the layout

    @property
    def gemms_outside_graphs(self) -> bool:
        """Whether the linears' GEMMs belong to another library (TE), which compiled graphs
        cannot contain: then a layer compiles only the pieces between them."""
        return self.local_matmul is not None or self.local_norm_matmul is not None or self.local_norm_mlp is not None

    # ---- layers
    def column_linear(self, input_size: int, output_sizes: Sequence[int], *, bias: bool, init_std: float,
                      input_norm: nn.Module | None = None) -> ColumnParallelLinear:
        """``input_norm``: the norm applied to this linear's input, which the linear may fuse
        (then ``.owns_norm`` is True and the caller skips the norm)."""
        return ColumnParallelLinear(input_size, output_sizes, self.tp, bias=bias, sequence_parallel=self.sequence_parallel,
                                    init_std=init_std, device=self.device, dtype=self.dtype, local_matmul=self.local_matmul,
                                    input_norm=input_norm, local_norm_matmul=self.local_norm_matmul)

    def row_linear(self, input_size: int, output_size: int, *, bias: bool, init_std: float) -> RowParallelLinear:
        return RowParallelLinear(input_size, output_size, self.tp, bias=bias, sequence_parallel=self.sequence_parallel,
                                 init_std=init_std, device=self.device, dtype=self.dtype, local_matmul=self.local_matmul)

    def fuses_norm_mlp(self, *, bias: bool) -> bool:
        """Whether ``norm_mlp`` will fuse a norm + MLP block: with a fused-block factory, no
        biases (fc2's would have to follow the TP sum) and no SP (an all-gather follows the norm)."""
        return self.local_norm_mlp is not None and not bias and not self.sequence_parallel

    def norm_mlp(self, norm: nn.Module, fc1: ColumnParallelLinear, fc2: RowParallelLinear, activation: str) -> Callable:
        """x -> fc2(act(fc1(norm(x)))) in one rank-local fused call on fc1's and fc2's shards
        (the parameters stay theirs: names, sharding tags and checkpoints unchanged), between
        the same two TP crossings as the separate linears. Only when ``fuses_norm_mlp``."""
        tp = self.tp
        for param in norm.parameters():  # each rank back-propagates its ffn columns into the norm
            sum_grad_over_tp(param, tp)
        return _BetweenTPCrossings(self.local_norm_mlp(norm, fc1.weight, fc2.weight, activation), tp)

    def embedding(self, num_embeddings: int, dim: int, *, init_std: float) -> VocabParallelEmbedding:
        return VocabParallelEmbedding(num_embeddings, dim, self.tp, init_std=init_std, device=self.device, dtype=self.dtype)

    def moe(self, cfg, layer_number: int) -> MoELayer:
        """Routed experts (router, dispatch over EP, experts split over EP and TP) for one layer."""
        return MoELayer(cfg, layer_number=layer_number, tp=self.tp, ep=self.ep, expert_dp=self.expert_dp, cp=self.cp,
                        grad_reduction=self.grad_reduction,
                        sequence_parallel=self.sequence_parallel, device=self.device, dtype=self.dtype)

    def attention(self, core: Callable, block_kernel) -> Callable:
        """The attention core over the whole sequence: ``core`` itself, or under CP the ring /
        all-to-all / all-gather around it (``block_kernel``: its log-sum-exp variant)."""
        if self.cp.size == 1:
            return core
        return ContextParallelAttention(self.cp, self.cp_comm_type, core, block_kernel)

    def replicated(self, param: nn.Parameter, *, init_std: float | None = None, init_value: float | None = None,
                   in_sequence_region: bool = False) -> nn.Parameter:
        """Tag a parameter every TP rank holds whole. Inside the sequence-sharded region its
        gradient is a per-rank partial sum, completed by an all-reduce."""
        tag_parameter(param, None, init_std, init_value)
        if in_sequence_region and self.sequence_parallel:
            sum_grad_over_tp(param, self.tp)
        return param

    def norm(self, module: nn.Module, weight: float = 1.0) -> nn.Module:
        """Register a norm layer (weight initialised to ``weight``, bias to 0); it runs in the sequence region."""
        for name, param in module.named_parameters():
            self.replicated(param, init_value=weight if name == "weight" else 0.0, in_sequence_region=True)
        return module

    # ---- activations crossing region boundaries
    def enter_sequence_region(self, x: torch.Tensor) -> torch.Tensor:
        """Full replicated [s, b, h] -> the layout the transformer layers take (SP: this rank's slice)."""
        return scatter_to_sequence(x, self.tp) if self.sequence_parallel else x

    def lm_logits(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """Output projection with a vocab-split weight (the tied embedding's or the head's)."""
        return column_parallel_matmul(x, weight, None, self.tp, self.sequence_parallel)

    def split_rng(self):
        """Random context for activations split over TP (heads, sequence slices)."""
        return tensor_parallel_rng() if self.tp.size > 1 else contextlib.nullcontext()

    def region_rng(self):
        """Random context for activations in the sequence region (split only under SP)."""
        return self.split_rng() if self.sequence_parallel else contextlib.nullcontext()
