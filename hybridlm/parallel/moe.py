"""Mixture-of-Experts: the router, token dispatch over the EP group, and the experts.

Experts are split over the EP group (E/EP stacked experts per rank, one ``[E/EP, ...]``
parameter per matrix tagged with ``ep_sharding``) and, like the dense MLP, over TP: an
expert's first matrix is column-split and its second row-split. TP-sharded rather than
TP-replicated experts because experts hold most of an MoE model's weights (45B of
Mixtral-8x7B's 47B): replicas would multiply that memory by TP and repeat each expert's
FLOPs on every TP rank, while sharding costs exactly the dense MLP's communication (one
all-reduce, or reduce-scatter under SP, of the layer's output). Every TP rank routes the
same tokens the same way, so each sends the same rows to its slice of every expert.

One micro-batch on one rank:
  1. router on this rank's tokens (its sequence slice under SP): fp32 softmax, top-k,
     weights renormalised over the chosen k (Mixtral); load-balancing loss and z-loss
     over the micro-batch's tokens;
  2. tokens and routing weights enter the TP region as the dense MLP's input does
     (all-gather under SP, else an identity whose backward sums over TP);
  3. with a capacity factor, each expert keeps its first assignments (first choices first);
  4. assignments sorted by expert, counts then tokens exchanged by all-to-all over EP,
     regrouped by local expert, the experts run as one grouped GEMM, and the way back;
  5. weighted sum per token, then leave the TP region (all-reduce / reduce-scatter).

The auxiliary losses never travel with the activations: ``_AttachAuxLoss`` seeds their
gradient during backward with the scale DeepSpeed applies to the LM loss (1/GAS), as if
they had been added to it, so each pipeline stage backpropagates its own layers' aux
loss and the block interface stays one tensor in, one tensor out (Megatron-core's
``MoEAuxLossAutoScaler``). Their values are kept in ``stats`` for the log.

Gradients: expert parameters are marked as DeepSpeed marks its own (``allreduce =
False``, ``group_name``) and a parameterless ``DeepSpeedExpertGroups`` module switches on
DeepSpeed's MoE handling, so DeepSpeed itself reduces expert gradients over the
expert-data-parallel group (dense ones over DP) and partitions their ZeRO state there.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from deepspeed.moe.layer import MoE as _DeepSpeedMoE
from torch import nn

from .context import sum_over_context_parallel
from .sequence import all_gather_dim0, gather_from_sequence, reduce_scatter_to_sequence, sum_grad_over_tp
from .state import SINGLE, GroupHandle
from .tensor_parallel import Sharding, copy_to_tensor_parallel, reduce_from_tensor_parallel, scaled_init_std, tag_parameter


def expert_group_name(ep_size: int) -> str:
    """DeepSpeed's name for an EP size's groups (``deepspeed.utils.groups`` parses the number back)."""
    return f"ep_size_{ep_size}"


class DeepSpeedExpertGroups(_DeepSpeedMoE):
    """Switches on DeepSpeed's MoE handling and hands it our expert groups.

    The engine reduces expert gradients over the expert-data-parallel group, gives ZeRO
    separate expert parameter groups and counts expert gradients correctly in the norm only
    when it finds an instance of its own ``deepspeed.moe.layer.MoE``; it then calls
    ``set_deepspeed_parallelism`` on it to create the groups. This parameterless stand-in
    passes that test without building DeepSpeed's layer, and registers ParallelState's
    groups instead: DeepSpeed's own construction puts several TP lanes in one
    expert-data-parallel group, which is wrong for TP-sharded experts.
    ``num_local_experts = 0`` keeps DeepSpeed's per-expert checkpoint files (laid out for
    its own layer) empty: our expert weights live in the module state.
    """

    def __init__(self, num_experts: int, ep: GroupHandle, expert_dp: GroupHandle):
        nn.Module.__init__(self)
        self.num_experts, self.num_local_experts, self.ep_size = num_experts, 0, ep.size
        self.expert_group_name = expert_group_name(ep.size)
        self._groups = (ep, expert_dp)

    def set_deepspeed_parallelism(self, use_data_before_expert_parallel_: bool = False) -> None:
        from deepspeed.utils import groups
        for groups_by_name, ranks_by_name, handle in (
                (groups._EXPERT_PARALLEL_GROUP, groups._EXPERT_PARALLEL_GROUP_RANKS, self._groups[0]),
                (groups._EXPERT_DATA_PARALLEL_GROUP, groups._EXPERT_DATA_PARALLEL_GROUP_RANKS, self._groups[1])):
            groups_by_name[self.expert_group_name] = handle.group
            ranks_by_name[self.expert_group_name] = dist.get_process_group_ranks(handle.group)

    def forward(self, *args, **kwargs):
        raise RuntimeError("DeepSpeedExpertGroups is a marker, not a layer")


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


class _AttachAuxLoss(torch.autograd.Function):
    """Identity on ``x``; backward also gives ``aux`` the gradient ``scale``, as if ``aux``
    had been added to the loss (which DeepSpeed scales by 1/GAS before backward)."""

    @staticmethod
    def forward(ctx, x, aux, scale):
        ctx.scale = scale
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, torch.full((), ctx.scale, dtype=torch.float32, device=grad.device), None


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward hands on a contiguous gradient: grouped_mm's backward
    rejects broadcast (stride-0) gradients."""

    @staticmethod
    def forward(ctx, x):
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad.contiguous()


def expert_matmul(x: torch.Tensor, weight: torch.Tensor, counts: list[int], grouped: bool) -> torch.Tensor:
    """Rows of ``x`` grouped by expert (``counts[e]`` rows each) times ``weight[e]^T``:
    one grouped GEMM where torch offers it for these shapes, else a loop over experts."""
    aligned = x.shape[-1] * x.element_size() % 16 == 0 and weight.shape[1] * weight.element_size() % 16 == 0
    if grouped and aligned and hasattr(F, "grouped_mm") and (x.device.type == "cpu" or x.dtype == torch.bfloat16):
        offsets = torch.tensor(counts, device=x.device).cumsum(0).to(torch.int32)
        return _ContiguousGrad.apply(F.grouped_mm(x.contiguous(), weight.transpose(1, 2), offs=offsets))
    return torch.cat([rows @ w.t() for rows, w in zip(x.split(counts), weight)])


def capacity_mask(top_idx: torch.Tensor, num_experts: int, capacity_factor: float) -> torch.Tensor:
    """[tokens, k] booleans: which assignments the experts keep. Each expert keeps at most
    ceil(factor x tokens x k / experts): every token's first choice before any second choice,
    earlier tokens first (GShard's priority). A rule of positions, not of router weights, so
    near-equal weights cannot make different layouts drop different tokens."""
    tokens, k = top_idx.shape
    capacity = math.ceil(capacity_factor * tokens * k / num_experts)
    expert = top_idx.t().reshape(-1)  # choice-major: all first choices, then all second choices
    order = torch.argsort(expert, stable=True)
    counts = torch.bincount(expert, minlength=num_experts)
    first = counts.cumsum(0) - counts
    place = torch.arange(expert.numel(), device=expert.device) - first[expert[order]]
    keep = torch.empty_like(expert, dtype=torch.bool)
    keep[order] = place < capacity
    return keep.view(k, tokens).t()


def _recomputing() -> bool:
    """True inside autograd's backward, i.e. in an activation-recompute forward."""
    return torch._C._current_graph_task_id() != -1


class RoutingStats:
    """Detached sums since the last report: assignments per expert (before dropping),
    dropped and total assignments, weighted aux and z losses, micro-batches."""

    def __init__(self, num_experts: int):
        self.num_experts = num_experts
        self.totals = None

    def add(self, counts, dropped, assigned: int, aux, z) -> None:
        scalars = torch.stack([dropped, aux, z]).double()
        row = torch.cat([counts.double(), scalars[:1], scalars.new_tensor([assigned]), scalars[1:], scalars.new_ones(1)])
        self.totals = row if self.totals is None else self.totals + row

    def pop(self, device) -> torch.Tensor:
        """[experts + 5] totals (zeros if nothing was recorded), and start over."""
        totals = self.totals if self.totals is not None else torch.zeros(self.num_experts + 5, dtype=torch.float64)
        self.totals = None
        return totals.to(device)


class Router(nn.Module):
    """Linear hidden -> expert logits (fp32), replicated over TP."""

    def __init__(self, hidden: int, num_experts: int, tp: GroupHandle, sequence_parallel: bool, *, init_std: float,
                 device=None, dtype=None):
        super().__init__()
        self.weight = tag_parameter(nn.Parameter(torch.empty(num_experts, hidden, device=device, dtype=dtype)), None, init_std)
        if sequence_parallel:  # each TP rank routes only its sequence slice
            sum_grad_over_tp(self.weight, tp)

    def forward(self, x):
        return F.linear(x.float(), self.weight.float())  # fp32 logits: top-k and softmax decide routing


class MoELayer(nn.Module):
    """Routed experts for [seq, batch, hidden] activations in the sequence region; see the module docstring."""

    def __init__(self, cfg, *, layer_number: int, tp: GroupHandle = SINGLE, ep: GroupHandle = SINGLE,
                 expert_dp: GroupHandle = SINGLE, cp: GroupHandle = SINGLE, sequence_parallel: bool = False, device=None, dtype=None):
        super().__init__()
        experts, ffn, hidden = cfg.num_experts, cfg.moe_ffn_hidden_size, cfg.hidden_size
        if experts % ep.size or ffn % tp.size:
            raise ValueError(f"{experts} experts of width {ffn} do not split over EP {ep.size} x TP {tp.size}")
        self.layer_number, self.tp, self.ep, self.cp = layer_number, tp, ep, cp
        self.sequence_parallel = sequence_parallel and tp.size > 1
        self.num_experts, self.local_experts, self.topk = experts, experts // ep.size, cfg.moe_router_topk
        self.capacity_factor, self.z_coeff = cfg.moe_capacity_factor, cfg.moe_z_loss_coeff
        self.aux_coeff = cfg.moe_aux_loss_coeff if cfg.moe_router_load_balancing_type == "aux_loss" else 0.0
        self.swiglu, self.grouped = cfg.swiglu, cfg.moe_grouped_gemm
        self.router = Router(hidden, experts, tp, self.sequence_parallel, init_std=cfg.init_method_std, device=device, dtype=dtype)
        blocks = (ffn, ffn) if cfg.swiglu else (ffn,)  # SwiGLU: [gate; up] in one matrix, each half split over TP
        self.w1 = self._expert_weight((sum(blocks) // tp.size, hidden), Sharding(1, blocks), cfg.init_method_std, device, dtype)
        self.w2 = self._expert_weight((hidden, ffn // tp.size), Sharding(2, (ffn,)),
                                      scaled_init_std(cfg.init_method_std, cfg.num_layers), device, dtype)
        self.deepspeed_groups = DeepSpeedExpertGroups(experts, ep, expert_dp)
        self.stats = RoutingStats(experts)
        self.aux_loss_scale = 1.0  # gradient of the aux losses; the trainer sets 1/GAS like DeepSpeed's loss scaling

    def _expert_weight(self, shape, tp_sharding: Sharding, init_std: float, device, dtype) -> nn.Parameter:
        param = tag_parameter(nn.Parameter(torch.empty(self.local_experts, *shape, device=device, dtype=dtype)), tp_sharding, init_std)
        param.ep_sharding = Sharding(0, (self.num_experts,))
        param.allreduce, param.group_name = False, expert_group_name(self.ep.size)  # DeepSpeed's expert-parameter marks
        return param

    # ---- the TP region, entered and left as the dense MLP's linears do
    def _enter(self, x):
        return gather_from_sequence(x, self.tp) if self.sequence_parallel else copy_to_tensor_parallel(x, self.tp)

    def _leave(self, y):
        return reduce_scatter_to_sequence(y, self.tp) if self.sequence_parallel else reduce_from_tensor_parallel(y, self.tp)

    def forward(self, x):
        s, b, h = x.shape
        logits = self.router(x).view(-1, self.num_experts)
        top_logits, top_idx = logits.topk(self.topk, dim=-1)
        top_weight = top_logits.softmax(-1).view(s, b, self.topk)
        top_idx = top_idx.view(s, b, self.topk)
        if self.sequence_parallel:
            top_idx = all_gather_dim0(top_idx, self.tp)
        top_idx = top_idx.reshape(-1, self.topk)
        aux, z, counts = self._aux_losses(logits, top_idx)
        tokens = self._enter(x).reshape(-1, h)
        weights = self._enter(top_weight).reshape(-1, self.topk)
        keep = capacity_mask(top_idx, self.num_experts, self.capacity_factor) if self.capacity_factor else None
        y = self._leave(self._dispatch(tokens, top_idx, weights, keep).view(-1, b, h))
        if self.training and not _recomputing():
            dropped = (~keep).sum().float() if keep is not None else torch.zeros((), device=x.device)
            self.stats.add(counts, dropped, top_idx.numel(), aux.detach(), z.detach())
        if self.training and torch.is_grad_enabled():
            y = _AttachAuxLoss.apply(y, aux + z, self.aux_loss_scale)
        return y

    def _aux_losses(self, logits, top_idx):
        """Load-balancing loss E/(T^2 k) x sum_e (probability mass_e x assignments_e) and z-loss
        mean(logsumexp^2), both over the micro-batch's T tokens (summed over TP under SP, and
        over CP, whose ranks hold the other slices of the same samples), weighted. Also returns
        the assignments of this rank's tokens."""
        prob_mass = logits.softmax(-1).sum(0)
        lse_squared = logits.logsumexp(-1).square().sum()
        if self.sequence_parallel:
            prob_mass = reduce_from_tensor_parallel(prob_mass, self.tp)
            lse_squared = reduce_from_tensor_parallel(lse_squared, self.tp)
        counts = torch.bincount(top_idx.reshape(-1), minlength=self.num_experts)
        tokens, all_counts = top_idx.shape[0], counts
        if self.cp.size > 1:
            prob_mass = sum_over_context_parallel(prob_mass, self.cp)
            lse_squared = sum_over_context_parallel(lse_squared, self.cp)
            all_counts = counts.clone()
            dist.all_reduce(all_counts, group=self.cp.group)
            tokens *= self.cp.size
        balance = self.num_experts / (tokens * tokens * self.topk) * (prob_mass * all_counts).sum()
        return self.aux_coeff * balance, self.z_coeff * lse_squared / tokens, counts

    def _dispatch(self, tokens, top_idx, weights, keep):
        """Each kept (token, expert) assignment through its expert; weighted sum per token (TP-partial)."""
        expert = top_idx.reshape(-1)
        token = torch.arange(expert.numel(), device=expert.device) // self.topk
        weight = weights.reshape(-1)
        if keep is not None:
            kept = keep.reshape(-1).nonzero().squeeze(1)
            expert, token, weight = expert[kept], token[kept], weight[kept]
        order = torch.argsort(expert, stable=True)
        token, weight = token[order], weight[order]
        counts = torch.bincount(expert, minlength=self.num_experts)
        out = self._exchange(tokens.index_select(0, token), counts)
        combined = torch.zeros(tokens.shape, dtype=torch.float32, device=tokens.device)
        combined = combined.index_add(0, token, out.float() * weight.unsqueeze(-1))
        return combined.to(tokens.dtype)

    def _exchange(self, x, counts):
        """Rows sorted by global expert -> this EP rank's experts -> back, in the same order."""
        if self.ep.size == 1:
            return self._experts(x, counts.tolist())
        ep, local = self.ep.size, self.local_experts
        received = torch.empty_like(counts)
        dist.all_to_all_single(received, counts, group=self.ep.group)  # [source, local expert] counts
        received = received.view(ep, local)
        send, recv = counts.view(ep, local).sum(1).tolist(), received.sum(1).tolist()
        x = _AllToAll.apply(x, recv, send, self.ep.group)
        segment = torch.repeat_interleave(torch.arange(ep * local, device=x.device), received.reshape(-1), output_size=sum(recv))
        regroup = torch.argsort((segment % local) * ep + segment // local, stable=True)  # (source, expert) -> (expert, source)
        y = self._experts(x[regroup], received.sum(0).tolist())
        return _AllToAll.apply(y[torch.argsort(regroup)], send, recv, self.ep.group)

    def _experts(self, x, counts: list[int]):
        h = expert_matmul(x, self.w1, counts, self.grouped)
        if self.swiglu:
            gate, up = h.chunk(2, dim=-1)
            h = F.silu(gate) * up
        else:
            h = F.gelu(h, approximate="tanh")
        return expert_matmul(h, self.w2, counts, self.grouped)


def set_aux_loss_scale(model: nn.Module, scale: float) -> None:
    """The gradient the aux losses get in backward: DeepSpeed divides the LM loss by GAS."""
    for module in model.modules():
        if isinstance(module, MoELayer):
            module.aux_loss_scale = scale


def moe_layers(model: nn.Module) -> list[MoELayer]:
    return [m for m in model.modules() if isinstance(m, MoELayer)]
