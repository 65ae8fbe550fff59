"""The router's arithmetic, as functions of tensors: no process groups, no modules.

Megatron-core's TopKRouter is the reference for what each option means (``router.py``,
``moe_utils.py``): the score functions, pre- and post-softmax top-k, group-limited top-k,
the scaling factor, the expert bias of auxiliary-loss-free balancing and its update rule,
the Switch load-balancing loss and the token-drop policies. Tokens are rows ``[tokens, ...]``
and a token's assignments are ``[tokens, k]`` (expert indices and routing weights), which
stays small with fine-grained experts (64 experts, top-8: 8 numbers a token, not 64).

Everything here is per token except ``keep_mask`` (it ranks a micro-batch's assignments per
expert), so the layer routes each rank's own tokens and gathers the result over TP.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class RouterOptions:
    """The routing flags of ``ModelConfig`` (``--moe-router-*``) that shape the top-k."""
    topk: int
    score_function: str = "softmax"
    pre_softmax: bool = False
    num_groups: Optional[int] = None
    group_topk: Optional[int] = None
    scaling_factor: Optional[float] = None

    @classmethod
    def of(cls, cfg) -> "RouterOptions":
        return cls(cfg.moe_router_topk, cfg.moe_router_score_function, cfg.moe_router_pre_softmax,
                   cfg.moe_router_num_groups, cfg.moe_router_group_topk, cfg.moe_router_topk_scaling_factor)


def scores(logits: torch.Tensor, function: str) -> torch.Tensor:
    """Per-expert scores in fp32 (softmax over all experts, or an element-wise sigmoid-type score)."""
    logits = logits.float()
    if function == "softmax":
        return logits.softmax(-1)
    if function == "sigmoid":
        return logits.sigmoid()
    if function == "sqrtsoftplus":
        return F.softplus(logits).sqrt()
    raise ValueError(f"unknown score function {function!r}")


def _topk(values: torch.Tensor, k: int, num_groups: Optional[int], group_topk: Optional[int]):
    """Top-k over the last dimension, within each row's best ``group_topk`` of ``num_groups``
    equal groups when those are set (a group scores the sum of its best k / group_topk values)."""
    if not group_topk:
        return values.topk(k, dim=-1)
    tokens, experts = values.shape
    grouped = values.view(tokens, num_groups, experts // num_groups)
    group_scores = grouped.topk(k // group_topk, dim=-1).values.sum(-1)
    best = group_scores.topk(group_topk, dim=-1).indices
    allowed = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
    masked = grouped.masked_fill(~allowed.unsqueeze(-1), float("-inf")).view(tokens, experts)
    return masked.topk(k, dim=-1)


def route(logits: torch.Tensor, options: RouterOptions, expert_bias: Optional[torch.Tensor] = None):
    """[tokens, experts] logits -> (routing weights [tokens, k] fp32, expert indices [tokens, k]).

    softmax: the top-k of the logits with a softmax over the chosen k (Mixtral), or with
    ``pre_softmax`` the top-k of a softmax over all experts, used as they are. sigmoid-type:
    the top-k of the scores (plus ``expert_bias``, which chooses experts but is no part of the
    weights), normalised over the chosen k when k > 1. Then ``scaling_factor``."""
    k, groups, chosen = options.topk, options.num_groups, options.group_topk
    if options.score_function == "softmax":
        if options.pre_softmax:
            weights, index = _topk(scores(logits, "softmax"), k, groups, chosen)
        else:
            top_logits, index = _topk(logits.float(), k, groups, chosen)
            weights = top_logits.softmax(-1)
    else:
        expert_scores = scores(logits, options.score_function)
        if expert_bias is not None:
            index = _topk(expert_scores.detach() + expert_bias.float(), k, groups, chosen).indices
            weights = expert_scores.gather(1, index)
        else:
            weights, index = _topk(expert_scores, k, groups, chosen)
        if k > 1:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    if options.scaling_factor:
        weights = weights * options.scaling_factor
    return weights, index


def scores_for_aux_loss(logits: torch.Tensor, function: str) -> torch.Tensor:
    """The probabilities the balancing losses use: a softmax, or sigmoid-type scores
    normalised over all experts (Megatron's ``compute_routing_scores_for_aux_loss``)."""
    expert_scores = scores(logits, function)
    if function != "softmax":
        expert_scores = expert_scores / (expert_scores.sum(-1, keepdim=True) + 1e-20)
    return expert_scores


def switch_loss(prob_mass: torch.Tensor, counts: torch.Tensor, prob_tokens: int, count_tokens: int, topk: int) -> torch.Tensor:
    """Switch/GShard balance E x sum_e P_e f_e, with P_e the mean probability of expert e
    (``prob_mass`` summed over ``prob_tokens`` tokens) and f_e its share of the assignments
    (``counts`` of ``count_tokens`` x k). Both token sets are the same one except in the global
    loss, where f comes from the whole data-parallel batch and P from this rank's tokens."""
    experts = prob_mass.shape[-1]
    return experts * (prob_mass * counts).sum(-1) / (prob_tokens * count_tokens * topk)


def expert_counts(index: torch.Tensor, num_experts: int, keep: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Assignments per expert (int64), counting only kept ones when ``keep`` is given; no host sync."""
    counts = torch.zeros(num_experts, dtype=torch.int64, device=index.device)
    ones = keep.reshape(-1).long() if keep is not None else torch.ones(index.numel(), dtype=torch.int64, device=index.device)
    return counts.scatter_add_(0, index.reshape(-1), ones)


def capacity(tokens: int, topk: int, num_experts: int, factor: float) -> int:
    """Megatron's expert capacity: ceil(tokens x k / experts x factor)."""
    return math.ceil((tokens * topk / num_experts) * factor)


def keep_mask(index: torch.Tensor, weights: torch.Tensor, num_experts: int, factor: float, policy: str) -> torch.Tensor:
    """[tokens, k] booleans: the assignments each expert keeps, at most ``capacity`` of them.

    probs: the highest routing weights (Megatron's default); position: the earliest tokens;
    choice_then_position: every token's first choice before any second choice, then the
    earliest tokens (GShard's priority). Ties go to the earlier token, so the rule depends
    only on the micro-batch, not on how it was split over ranks. Weights are compared at bf16
    precision: near-identical tokens (repeated text) get weights a few fp32 ulps apart, and
    the last bits differ between layouts (TP splits the matmuls, DP sums gradients in another
    order), so exact fp32 ranking dropped different tokens at different layouts; at bf16 they
    tie and the earlier token wins (a layout can still differ where a weight sits within its
    last bits of a bf16 rounding boundary)."""
    tokens, k = index.shape
    limit = capacity(tokens, k, num_experts, factor)
    if policy == "choice_then_position":
        order = torch.arange(tokens * k, device=index.device).view(tokens, k).t().reshape(-1)  # choice-major
    elif policy == "position":
        order = torch.arange(tokens * k, device=index.device)
    elif policy == "probs":  # compared at bf16 precision (as in Megatron's bf16 runs), ties to the earlier token
        order = torch.sort(weights.reshape(-1).to(torch.bfloat16), descending=True, stable=True).indices
    else:
        raise ValueError(f"unknown drop policy {policy!r}")
    expert = index.reshape(-1)[order]
    by_expert = torch.sort(expert, stable=True).indices  # within an expert, ``order`` is kept
    counts = expert_counts(expert, num_experts)
    first = counts.cumsum(0) - counts
    rank = torch.empty_like(by_expert)
    rank[by_expert] = torch.arange(expert.numel(), device=index.device) - first[expert[by_expert]]
    keep = torch.empty(tokens * k, dtype=torch.bool, device=index.device)
    keep[order] = rank < limit
    return keep.view(tokens, k)


def updated_expert_bias(bias: torch.Tensor, counts: torch.Tensor, rate: float) -> torch.Tensor:
    """DeepSeek-V3's auxiliary-loss-free update (Megatron's ``get_updated_expert_bias``): each
    expert's bias moves by ``rate`` towards equal load, up when it got fewer assignments than
    the mean, down when more. ``counts`` [..., experts] must already be summed over every rank
    that routed other tokens, so that each rank holding the layer makes the same update."""
    counts = counts.double()
    mean = counts.sum(-1, keepdim=True) / counts.shape[-1]
    return bias + torch.sign(mean - counts).to(bias.dtype) * rate
