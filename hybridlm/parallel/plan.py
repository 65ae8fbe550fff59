"""The layer factory the model is built with, and the two small records it is built from.

The blocks in ``hybridlm.model.gpt`` ask a ``LayerFactory`` for "a linear whose output is
split", "a linear whose input is split", "an embedding", "a norm", "routed experts", "the
attention core over the whole sequence", and for the points where activations enter and leave
the sequence-sharded region. They never ask whether they are tensor-, sequence- or
context-parallel: with one rank in every group the same layers degrade to plain matmuls with no
communication.

The parallel set-up is split by responsibility, each part handed only to who needs it:

    ModelGroups     the process groups the layers communicate over (from ``ParallelState``)
    LocalOps        which implementation computes each rank-local piece (PyTorch or fused
                    kernels; Transformer Engine's GEMMs)
    LayerFactory    the layers of a block, for those groups and implementations (here)
    RandomStreams   which random stream a dropout draws from (``hybridlm.parallel.random``)
    recompute_in_backward   activation recompute (``hybridlm.parallel.random``)
    LossReducer     what a loss asks of the layout, beside the loss contract (``hybridlm.parallel.loss``)

How the built layers run (the FP8 context, recompute, compile, CUDA graphs) is applied to the
layer list from outside (``hybridlm.model.execution``).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import torch
from torch import nn

from ..ops import Kernels, reference_kernels
from .context import ContextParallelAttention
from .fused_head import HeadLogits
from .moe import MoELayer
from .random import RandomStreams
from .sequence import gather_from_sequence, scatter_to_sequence, sum_grad_over_tp
from .state import SINGLE, GroupHandle
from .tensor_parallel import (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding,
                              column_parallel_matmul, copy_to_tensor_parallel, reduce_from_tensor_parallel, tag_parameter)


@dataclass(frozen=True)
class ModelGroups:
    """The process groups the model's layers communicate over. ``cp`` splits every sample's
    sequence (``hybridlm.parallel.context``); ``grad_reduction`` is DP x CP, over which MoE sums
    what the whole data-parallel batch routed (``ParallelState`` says why)."""
    tp: GroupHandle = SINGLE
    cp: GroupHandle = SINGLE
    ep: GroupHandle = SINGLE
    expert_dp: GroupHandle = SINGLE
    grad_reduction: GroupHandle = SINGLE

    @classmethod
    def of(cls, ps) -> "ModelGroups":
        """The groups of a ``ParallelState``."""
        return cls(tp=ps.tp, cp=ps.cp, ep=ps.ep, expert_dp=ps.expert_dp, grad_reduction=ps.grad_reduction)


@dataclass(frozen=True)
class LocalOps:
    """Which implementation computes each rank-local piece (Megatron-core's spec: local or Transformer
    Engine layers, without forking the model code). ``kernels``: RMSNorm / RoPE / SwiGLU
    (``hybridlm.ops.select_kernels``; default: the PyTorch definitions); ``matmul``: a factory
    (weight, bias) -> callable replacing the linears' GEMM (TE's Linear); ``norm_matmul``: a factory
    (norm, weight, bias) fusing a norm into the column linear after it (TE's LayerNormLinear);
    ``norm_mlp``: a factory (norm, fc1 weight, fc2 weight, activation) for a whole norm + MLP block
    on this rank's shards (TE's LayerNormMLP); ``grouped_experts``: a factory (w1, w2, activation) computing
    an MoE layer's experts on its stacked parameters (TE's GroupedLinear, for FP8 experts)."""
    kernels: Kernels = field(default_factory=reference_kernels)
    matmul: Optional[Callable] = None
    norm_matmul: Optional[Callable] = None
    norm_mlp: Optional[Callable] = None
    grouped_experts: Optional[Callable] = None


class _BetweenTPCrossings:
    """x -> reduce over TP(block(copy to TP(x))): a rank-local block between the two TP crossings.
    An object rather than a closure, so that ``block`` stays reachable (the FP8 bookkeeping of
    CUDA graph capture looks for the TE modules a layer calls)."""

    def __init__(self, block: Callable, tp: GroupHandle):
        self.block, self.tp = block, tp

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return reduce_from_tensor_parallel(self.block(copy_to_tensor_parallel(x, self.tp)), self.tp)


class LayerFactory:
    """The layers of a block for ``groups``: ``sequence_parallel`` keeps activations between the
    linears split along the sequence over TP; ``cp_comm_type`` is how attention crosses the CP
    group; ``ops`` the rank-local implementations; ``device``, ``dtype`` where parameters are made.
    ``rng`` says which random stream a dropout on the activations it hands out draws from."""

    def __init__(self, groups: ModelGroups = ModelGroups(), *, sequence_parallel: bool = False, cp_comm_type: str = "p2p",
                 ops: Optional[LocalOps] = None, device=None, dtype=None):
        self.groups, self.tp = groups, groups.tp
        self.sequence_parallel = sequence_parallel and groups.tp.size > 1
        self.cp_comm_type = cp_comm_type
        self.ops = ops or LocalOps()
        self.kernels = self.ops.kernels
        self.device, self.dtype = device, dtype
        self.rng = RandomStreams(groups.tp, self.sequence_parallel)

    # ---- layers
    def column_linear(self, input_size: int, output_sizes: Sequence[int], *, bias: bool, init_std: float,
                      input_norm: nn.Module | None = None) -> ColumnParallelLinear:
        """``input_norm``: the norm applied to this linear's input, which the linear may fuse
        (then ``.owns_norm`` is True and the caller skips the norm)."""
        return ColumnParallelLinear(input_size, output_sizes, self.tp, bias=bias, sequence_parallel=self.sequence_parallel,
                                    init_std=init_std, device=self.device, dtype=self.dtype, local_matmul=self.ops.matmul,
                                    input_norm=input_norm, local_norm_matmul=self.ops.norm_matmul)

    def row_linear(self, input_size: int, output_size: int, *, bias: bool, init_std: float) -> RowParallelLinear:
        return RowParallelLinear(input_size, output_size, self.tp, bias=bias, sequence_parallel=self.sequence_parallel,
                                 init_std=init_std, device=self.device, dtype=self.dtype, local_matmul=self.ops.matmul)

    def fuses_norm_mlp(self, *, bias: bool) -> bool:
        """Whether ``norm_mlp`` will fuse a norm + MLP block: with a fused-block factory, no
        biases (fc2's would have to follow the TP sum) and no SP (an all-gather follows the norm)."""
        return self.ops.norm_mlp is not None and not bias and not self.sequence_parallel

    def norm_mlp(self, norm: nn.Module, fc1: ColumnParallelLinear, fc2: RowParallelLinear, activation: str) -> Callable:
        """x -> fc2(act(fc1(norm(x)))) in one rank-local fused call on fc1's and fc2's shards
        (the parameters stay theirs: names, sharding tags and checkpoints unchanged), between
        the same two TP crossings as the separate linears. Only when ``fuses_norm_mlp``."""
        tp = self.tp
        for param in norm.parameters():  # each rank back-propagates its ffn columns into the norm
            sum_grad_over_tp(param, tp)
        return _BetweenTPCrossings(self.ops.norm_mlp(norm, fc1.weight, fc2.weight, activation), tp)

    def embedding(self, num_embeddings: int, dim: int, *, init_std: float) -> VocabParallelEmbedding:
        return VocabParallelEmbedding(num_embeddings, dim, self.tp, init_std=init_std, device=self.device, dtype=self.dtype)

    def moe(self, cfg, layer_number: int) -> MoELayer:
        """Routed experts (router, dispatch over EP, experts split over EP and TP) for one layer."""
        g = self.groups
        return MoELayer(cfg, layer_number=layer_number, tp=g.tp, ep=g.ep, expert_dp=g.expert_dp, cp=g.cp,
                        grad_reduction=g.grad_reduction, sequence_parallel=self.sequence_parallel,
                        grouped_experts=self.ops.grouped_experts, device=self.device, dtype=self.dtype)

    def attention(self, core: Callable, block_kernel) -> Callable:
        """The attention core over the whole sequence: ``core`` itself, or under CP the ring /
        all-to-all / all-gather around it (``block_kernel``: its log-sum-exp variant)."""
        if self.groups.cp.size == 1:
            return core
        return ContextParallelAttention(self.groups.cp, self.cp_comm_type, core, block_kernel)

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

    def lm_head_logits(self, x: torch.Tensor, weight: torch.Tensor) -> HeadLogits:
        """The same projection left to the loss (``hybridlm.parallel.fused_head``): ``x`` across the head's TP
        crossing, beside the weight."""
        return HeadLogits(gather_from_sequence(x, self.tp) if self.sequence_parallel else copy_to_tensor_parallel(x, self.tp), weight)
