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
  1. router on this rank's tokens (its sequence slice under SP): fp32 logits, the score
     function and top-k of ``moe_routing.route`` (softmax over the chosen k as Mixtral by
     default; pre-softmax, sigmoid, groups, expert bias, scaling as Megatron's flags say);
     the balancing loss and z-loss over the micro-batch's tokens (its whole sequences: summed
     over TP under SP and over CP, whose ranks hold the other slices); a benchmark's
     --moe-router-force-load-balancing routes by random logits instead (``_RandomLogits``);
  2. expert choices and routing weights gathered over TP under SP, tokens entering the TP
     region as the dense MLP's input does (all-gather under SP, else an identity whose
     backward sums over TP), so every TP rank holds the micro-batch's assignments;
  3. with a capacity factor, each expert keeps what the drop policy prefers, decided on the
     whole micro-batch, so it does not depend on how the tokens were split over ranks;
  4. ``moe_dispatch``: assignments sorted by expert, exchanged by all-to-all over EP, the
     experts as one grouped GEMM per matrix (torch's in bf16; Transformer Engine's under FP8),
     and the way back;
  5. weighted sum per token, then leave the TP region (all-reduce / reduce-scatter).

The auxiliary losses never travel with the activations: ``_AttachAuxLoss`` seeds their
gradient during backward with the scale the loss contract states for them
(``hybridlm.parallel.loss.aux_loss_scale``: 1/GAS, which DeepSpeed applies to the LM loss), as if
they had been added to it, so each pipeline stage backpropagates its own layers' aux
loss and the block interface stays one tensor in, one tensor out (Megatron-core's
``MoEAuxLossAutoScaler``). Their values are kept in ``stats`` for the log. They are
computed in the pass whose backward runs: with activation recompute, the recompute.

After each optimizer step ``end_moe_step`` moves the expert biases of auxiliary-loss-free
balancing (the step's kept assignments, summed over DP x CP) and resets the global balance
loss's counts.

Gradients: expert parameters are marked as DeepSpeed marks its own (``allreduce =
False``, ``group_name``) and a parameterless ``DeepSpeedExpertGroups`` module switches on
DeepSpeed's MoE handling, so DeepSpeed itself reduces expert gradients over the
expert-data-parallel group (dense ones over DP x CP) and partitions their ZeRO state there.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from deepspeed.moe.layer import MoE as _DeepSpeedMoE
from torch import nn
from torch.profiler import record_function

from .context import sum_over_context_parallel
from .moe_dispatch import exchange, expert_matmul, permute, unpermute
from .moe_routing import (RouterOptions, expert_counts, keep_mask, route, scores_for_aux_loss, switch_loss,
                          updated_expert_bias)
from .random import RandomStreams
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


class _RandomLogits(torch.autograd.Function):
    """--moe-router-force-load-balancing: standard normal logits in place of the router's, whose gradient passes
    straight through (Megatron-core's ``RandomSTE``). Drawn from the stream of the activations' region (the default
    generator, the same on every TP rank; the TP stream under SP, whose ranks route their own slices): DeepSpeed's
    checkpoint restores both, so a recomputed layer routes as its first forward did."""

    @staticmethod
    def forward(ctx, logits):
        return torch.randn_like(logits)

    @staticmethod
    def backward(ctx, grad):
        return grad


def _recomputing() -> bool:
    """True inside autograd's backward, i.e. in an activation-recompute forward."""
    return torch._C._current_graph_task_id() != -1



class RoutingStats:
    """Detached sums since the last report: assignments per expert (before dropping), dropped
    and total assignments and micro-batches (added once per routed micro-batch), weighted
    balance and z losses (added where they are computed: the pass whose backward runs)."""

    def __init__(self, num_experts: int):
        self.num_experts = num_experts
        self.totals = None

    def _row(self, like: torch.Tensor) -> torch.Tensor:
        if self.totals is None:
            self.totals = torch.zeros(self.num_experts + 5, dtype=torch.float64, device=like.device)
        return self.totals

    def add_routing(self, counts: torch.Tensor, dropped: torch.Tensor, assigned: int) -> None:
        row, e = self._row(counts), self.num_experts  # in place on the device: no host round trip
        row[:e] += counts
        row[e] += dropped
        row[e + 1] += assigned
        row[e + 4] += 1

    def add_losses(self, aux: torch.Tensor, z: torch.Tensor) -> None:
        row, e = self._row(aux), self.num_experts
        row[e + 2] += aux.detach()
        row[e + 3] += z.detach()

    def pop(self, device) -> torch.Tensor:
        """[experts + 5] totals (zeros if nothing was recorded), and start over."""
        totals = self.totals if self.totals is not None else torch.zeros(self.num_experts + 5, dtype=torch.float64)
        self.totals = None
        return totals.to(device)


class Router(nn.Module):
    """Linear hidden -> expert logits (fp32), replicated over TP; with auxiliary-loss-free
    balancing also the per-expert bias (a checkpointed fp32 buffer, not a parameter: the
    optimizer never touches it) and the kept assignments counted since its last update."""

    def __init__(self, hidden: int, num_experts: int, tp: GroupHandle, sequence_parallel: bool, *, init_std: float,
                 expert_bias: bool = False, device=None, dtype=None):
        super().__init__()
        self.weight = tag_parameter(nn.Parameter(torch.empty(num_experts, hidden, device=device, dtype=dtype)), None, init_std)
        if sequence_parallel:  # each TP rank routes only its sequence slice
            sum_grad_over_tp(self.weight, tp)
        bias, counts = None, None
        if expert_bias:
            bias = torch.zeros(num_experts, device=device, dtype=torch.float32)
            counts = torch.zeros(num_experts, device=device, dtype=torch.int64)
        self.register_buffer("expert_bias", bias)
        self.register_buffer("tokens_since_update", counts, persistent=False)

    def forward(self, x):
        return F.linear(x.float(), self.weight.float())  # fp32 logits: top-k and softmax decide routing

    def _apply(self, fn, recurse=True):
        """Keep the bias in fp32 whatever the module is cast to (its steps are 1e-3)."""
        super()._apply(fn, recurse)
        if self.expert_bias is not None and self.expert_bias.dtype != torch.float32:
            self.expert_bias = self.expert_bias.float()
        return self


class MoELayer(nn.Module):
    """Routed experts for [seq, batch, hidden] activations in the sequence region; see the module docstring."""

    def __init__(self, cfg, *, layer_number: int, tp: GroupHandle = SINGLE, ep: GroupHandle = SINGLE,
                 expert_dp: GroupHandle = SINGLE, cp: GroupHandle = SINGLE, grad_reduction: GroupHandle = SINGLE,
                 sequence_parallel: bool = False, grouped_experts=None, device=None, dtype=None):
        super().__init__()
        experts, ffn, hidden = cfg.num_experts, cfg.moe_ffn_hidden_size, cfg.hidden_size
        if experts % ep.size or ffn % tp.size:
            raise ValueError(f"{experts} experts of width {ffn} do not split over EP {ep.size} x TP {tp.size}")
        self.layer_number, self.tp, self.ep, self.cp, self.grad_reduction = layer_number, tp, ep, cp, grad_reduction
        self.sequence_parallel = sequence_parallel and tp.size > 1
        self.num_experts, self.local_experts, self.topk = experts, experts // ep.size, cfg.moe_router_topk
        self.options = RouterOptions.of(cfg)
        self.capacity_factor, self.drop_policy = cfg.moe_capacity_factor, cfg.moe_token_drop_policy
        self.balancing = cfg.moe_router_load_balancing_type if cfg.moe_aux_loss_coeff else "none"
        self.aux_coeff, self.z_coeff = cfg.moe_aux_loss_coeff, cfg.moe_z_loss_coeff
        self.swiglu, self.grouped = cfg.swiglu, cfg.moe_grouped_gemm
        self.random_routing = RandomStreams(tp, self.sequence_parallel) if cfg.moe_router_force_load_balancing else None
        self.router = Router(hidden, experts, tp, self.sequence_parallel, init_std=cfg.init_method_std,
                             expert_bias=cfg.moe_router_enable_expert_bias, device=device, dtype=dtype)
        blocks = (ffn, ffn) if cfg.swiglu else (ffn,)  # SwiGLU: [gate; up] in one matrix, each half split over TP
        self.w1 = self._expert_weight((sum(blocks) // tp.size, hidden), Sharding(1, blocks), cfg.init_method_std, device, dtype)
        self.w2 = self._expert_weight((hidden, ffn // tp.size), Sharding(2, (ffn,)),
                                      scaled_init_std(cfg.init_method_std, cfg.num_layers), device, dtype)
        # ``grouped_experts``: a factory (w1, w2, activation) of another implementation of the experts on these
        # parameters (Transformer Engine's FP8 grouped GEMMs, hybridlm.model.transformer_engine.TEGroupedExperts)
        self.experts_impl = grouped_experts(self.w1, self.w2, self._activation) if grouped_experts and self.grouped else None
        self.deepspeed_groups = DeepSpeedExpertGroups(experts, ep, expert_dp)
        self.stats = RoutingStats(experts)
        self.aux_loss_scale = 1.0  # gradient of the aux losses; the trainer sets parallel.loss.aux_loss_scale
        self.global_counts, self.global_micro_batches = None, 0  # global_aux_loss: this step's DP x CP-summed counts so far

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

    @property
    def sequence_share(self) -> int:
        """How many ranks hold slices of each sequence: TP under SP, times CP."""
        return (self.tp.size if self.sequence_parallel else 1) * self.cp.size

    def _sum_over_tp(self, x):
        """A sum over this rank's tokens -> over its CP slice of the micro-batch (SP: the TP ranks hold slices)."""
        return reduce_from_tensor_parallel(x, self.tp) if self.sequence_parallel else x

    def _sum_over_sequence(self, x):
        """A sum over this rank's tokens -> over the micro-batch's whole sequences: over TP under SP,
        then over CP, whose ranks hold the other slices (an all-reduce whose backward is again one:
        every CP rank then holds the same loss, as DeepSpeed's average over DP x CP expects)."""
        return sum_over_context_parallel(self._sum_over_tp(x), self.cp)

    def forward(self, x):
        s, b, h = x.shape
        with_losses = self.training and torch.is_grad_enabled()  # the pass whose backward runs (a recompute's, if any)
        with record_function("hybridlm.moe.route"):  # names in a --profile-step-range trace
            logits = self.router(x).view(-1, self.num_experts)
            if self.random_routing is not None:
                with self.random_routing.region():
                    logits = _RandomLogits.apply(logits)
            weights, index = route(logits, self.options, self.router.expert_bias)
            if with_losses:
                aux, z = self._balance_loss(logits, s, b), self._z_loss(logits)
        if self.sequence_parallel:
            index = all_gather_dim0(index.view(s, b, self.topk), self.tp)
        index = index.reshape(-1, self.topk)  # the micro-batch's assignments, on every TP rank
        weights = self._enter(weights.view(s, b, self.topk)).reshape(-1, self.topk)
        tokens = self._enter(x).reshape(-1, h)
        keep = None
        if self.capacity_factor:
            keep = keep_mask(index, weights.detach(), self.num_experts, self.capacity_factor, self.drop_policy)
        with record_function("hybridlm.moe.dispatch"):
            y = self._dispatch(tokens, index, weights, keep)
        y = self._leave(y.view(-1, b, h))
        if self.training and not _recomputing():  # once per micro-batch
            dropped = (~keep).sum().float() if keep is not None else torch.zeros((), device=x.device)
            self.stats.add_routing(expert_counts(index, self.num_experts), dropped, index.numel())
            if self.router.expert_bias is not None:
                self.router.tokens_since_update += expert_counts(index, self.num_experts, keep)
        if with_losses:
            self.stats.add_losses(aux, z)
            y = _AttachAuxLoss.apply(y, aux + z, self.aux_loss_scale)
        return y

    def _balance_loss(self, logits, s: int, b: int):
        """--moe-router-load-balancing-type, weighted by --moe-aux-loss-coeff: Switch's E x sum_e P_e f_e
        over the micro-batch (aux_loss), per sequence and averaged (seq_aux_loss), or with f from the
        whole data-parallel batch (global_aux_loss). P and f come from the scores and top-k of
        ``scores_for_aux_loss`` (no expert bias, no groups), as in Megatron."""
        if self.balancing == "none":
            return logits.new_zeros(())
        probs = scores_for_aux_loss(logits, self.options.score_function)
        chosen = probs.detach().topk(self.topk, dim=-1).indices
        seq = s * self.sequence_share  # the full sequence length
        if self.balancing == "seq_aux_loss":
            mass = self._sum_over_sequence(probs.view(s, b, -1).sum(0))  # [b, experts]
            sequence = torch.arange(b, device=logits.device).view(1, b, 1).expand(s, b, self.topk)
            counts = expert_counts(sequence.reshape(-1) * self.num_experts + chosen.reshape(-1), b * self.num_experts)
            counts = self._sum_over_sequence(counts.view(b, -1))
            return self.aux_coeff * switch_loss(mass, counts, seq, seq, self.topk).mean()
        mass = self._sum_over_sequence(probs.sum(0))
        tokens = seq * b
        if self.balancing == "global_aux_loss":
            # f of the whole data-parallel batch: every rank's counts, summed over DP x CP (over TP under SP first)
            counts = self._sum_over_tp(expert_counts(chosen, self.num_experts)).double()
            if self.grad_reduction.size > 1:
                dist.all_reduce(counts, group=self.grad_reduction.group)
            self.global_counts = counts if self.global_counts is None else self.global_counts + counts
            self.global_micro_batches += 1
            samples = self.grad_reduction.size // self.cp.size  # DP: micro-batches of whole sequences in the batch
            return self.aux_coeff * switch_loss(mass, self.global_counts / self.global_micro_batches, tokens,
                                                tokens * samples, self.topk).float()
        counts = self._sum_over_sequence(expert_counts(chosen, self.num_experts))
        return self.aux_coeff * switch_loss(mass, counts, tokens, tokens, self.topk)

    def _z_loss(self, logits):
        """Weighted mean of logsumexp^2 over the micro-batch's tokens."""
        if not self.z_coeff:
            return logits.new_zeros(())
        tokens = logits.shape[0] * self.sequence_share
        return self.z_coeff * self._sum_over_sequence(logits.logsumexp(-1).square().sum()) / tokens

    def _dispatch(self, tokens, index, weights, keep):
        """Each kept (token, expert) assignment through its expert; weighted sum per token (TP-partial)."""
        token, weight, counts = permute(index, weights, keep, self.num_experts)
        rows = exchange(tokens.index_select(0, token), counts, self.ep, self.local_experts, self._experts)
        return unpermute(rows, token, weight, tokens.shape[0])

    def _experts(self, x, counts):
        if self.experts_impl is not None:
            return self.experts_impl(x, counts)
        h = expert_matmul(x, self.w1, counts, self.grouped)
        return expert_matmul(self._activation(h), self.w2, counts, self.grouped)

    def _activation(self, h):
        if self.swiglu:
            gate, up = h.chunk(2, dim=-1)
            return F.silu(gate) * up
        return F.gelu(h, approximate="tanh")

    @torch.no_grad()
    def end_step(self, reduced_counts: torch.Tensor | None, bias_update_rate: float) -> None:
        """After the optimizer step: the expert bias moves (given the step's counts summed over DP x CP),
        the global balance loss forgets this step's counts."""
        if self.router.expert_bias is not None and reduced_counts is not None:
            self.router.expert_bias.copy_(updated_expert_bias(self.router.expert_bias, reduced_counts, bias_update_rate))
            self.router.tokens_since_update.zero_()
        self.global_counts, self.global_micro_batches = None, 0


def end_moe_step(model: nn.Module, grad_reduction: GroupHandle, bias_update_rate: float) -> None:
    """Called once after every optimizer step (every rank): updates the expert biases of
    auxiliary-loss-free balancing from the step's kept assignments, summed over DP x CP
    (``ParallelState.grad_reduction``: each DP or CP rank routed other tokens; each TP rank
    counted its whole micro-batch slice already) in one all-reduce, so every rank holding a
    layer makes the same update; resets the global balance loss's counts."""
    layers = moe_layers(model)
    biased = [layer for layer in layers if layer.router.expert_bias is not None]
    reduced = {}
    if biased:
        counts = torch.stack([layer.router.tokens_since_update for layer in biased])
        if grad_reduction.size > 1:
            dist.all_reduce(counts, group=grad_reduction.group)
        reduced = dict(zip(map(id, biased), counts))
    for layer in layers:
        layer.end_step(reduced.get(id(layer)), bias_update_rate)


def set_aux_loss_scale(model: nn.Module, scale: float) -> None:
    """The gradient the aux losses get in backward (``hybridlm.parallel.loss.aux_loss_scale``)."""
    for module in model.modules():
        if isinstance(module, MoELayer):
            module.aux_loss_scale = scale


def moe_layers(model: nn.Module) -> list[MoELayer]:
    return [m for m in model.modules() if isinstance(m, MoELayer)]
