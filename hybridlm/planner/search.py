"""Candidate layouts for a model on a cluster, a simple step-time model, and the recommendation.

Candidates: TP in {1, 2, 4, 8} within a node (heads, key/value groups and the MLP width
divisible by it), PP dividing the layer count, DP what is left, ZeRO 0-3 (2 and 3 only with
PP = 1, as DeepSpeed's pipeline engine allows), sequence parallelism whenever TP > 1,
recompute none / selective / full; for MoE models EP dividing both the experts and DP x CP. For
sequences of ``LONG_SEQUENCE`` tokens or more, context parallelism (CP in {2, 4, 8, ...}, TP x CP
within a node, the sequence divisible by 2 x CP, ring attention) joins the candidates: it divides
activations and logits by CP where recompute only trims them.

A layout fits when its planned peak plus headroom (``FRAGMENTATION`` of it for the caching
allocator, plus ``RESERVED_GIB`` for the CUDA context, NCCL and library workspaces, which
``max_memory_allocated`` does not count, but at most ``RESERVED_SHARE`` of a small device's memory,
such as the tiny preset's 1 GiB CPU ranks; ``Cluster.reserved_gib`` sets it) is within the GPU's memory.

Step time, to rank the layouts that fit (a coarse model: it orders layouts, it does not
predict seconds; the constants are an H100/H200 node with NVLink and one 400 Gb/s NIC per GPU):

  compute     model FLOPs per GPU (Megatron-LM's rule, training.metrics) / (peak x ``BASE_MFU``), x 4/3 with full recompute (one more
              forward), x (1 + attention-core share / 3) with selective
  bubble      x (1 + (PP - 1) / micro-batches) for 1F1B
  TP          4 all-reduces (or reduce-scatter + all-gather) of the layer's activations per
              layer per micro-batch, over NVLink, not overlapped
  CP          ring attention sends each layer's local K/V around the ring (CP - 1 hops forward;
              K/V and fp32 dK/dV backward), over NVLink within a node, overlapped with the
              blocks' attention: only what exceeds the attention compute is exposed
  DP          one gradient reduction per step over the network once DP x CP spans nodes (expert
              gradients only over the DP x CP / EP ranks holding the same experts); ZeRO-2
              overlaps half of it with backward (overlap_comm); ZeRO-3 adds its parameter
              gathers (x 1.5) and waits on them
  EP          per MoE layer and micro-batch, the tokens' k rows to the experts and back, in
              forward and backward (x 1.5 with full recompute), (EP - 1) / EP of them leaving
              the GPU, over NVLink while TP x EP fits a node, not overlapped
  offload     optimizer states over PCIe and the CPU's Adam: 16 bytes per parameter at 10 GB/s

At equal memory it thus prefers less TP, fewer pipeline bubbles and less recompute, and EP
where the expert memory or gradient reduction it saves outweighs the all-to-all.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Callable, Iterable, Optional

from ..config import ModelConfig
from ..training.metrics import attention_core_flops_per_token, flops_per_token
from .memory import GIB, Breakdown, Layout, estimate, stage_layers, stage_parameters

FRAGMENTATION = 0.10
RESERVED_GIB = 2.0
RESERVED_SHARE = 0.10
BASE_MFU = 0.45
PEAK_TFLOPS = 989.0
NVLINK_GBPS = 300.0  # per GPU, bytes/s (x 1e9), achievable all-reduce bus bandwidth
NETWORK_GBPS = 40.0  # per GPU across nodes
OFFLOAD_GBPS = 10.0
LONG_SEQUENCE = 16384  # context parallelism is a candidate from this sequence length on


@dataclass(frozen=True)
class Cluster:
    gpus: int
    gpus_per_node: int = 8
    gpu_memory_gib: float = 80.0
    reserved_gib: Optional[float] = None  # memory outside the planned peak (default: see ``reserved``)

    @property
    def reserved(self) -> float:
        """GiB per device the allocator's peak does not count: RESERVED_GIB, but at most RESERVED_SHARE
        of the device, so that a 1 GiB CPU rank (no CUDA context, no NCCL) is not ruled out by it."""
        return self.reserved_gib if self.reserved_gib is not None else min(RESERVED_GIB, RESERVED_SHARE * self.gpu_memory_gib)


@dataclass
class Plan:
    layout: Layout
    memory: Breakdown
    step_seconds: float
    fits: bool
    reserved_gib: float = RESERVED_GIB

    @property
    def needed_gib(self) -> float:
        return self.memory.total * (1 + FRAGMENTATION) / GIB + self.reserved_gib


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidate_layouts(cfg: ModelConfig, cluster: Cluster, *, micro_batch_size: int, global_batch_size: int,
                      bf16: bool = True, recompute: Iterable = (None, "selective", "full"),
                      zero: Iterable[int] = (0, 1, 2, 3), allow_offload: bool = False,
                      cp_sizes: Optional[Iterable[int]] = None) -> list[Layout]:
    """Every layout the trainer accepts for this model on ``cluster`` (see the module docstring);
    ``cp_sizes`` replaces the CP sizes considered."""
    out = []
    for tp in (1, 2, 4, 8):
        if tp > cluster.gpus_per_node or cluster.gpus % tp:
            continue
        if cfg.num_attention_heads % tp or cfg.num_query_groups % tp or cfg.ffn_hidden_size % tp:
            continue
        if cfg.num_experts and cfg.moe_ffn_hidden_size % tp:
            continue
        cps = list(cp_sizes) if cp_sizes is not None else context_parallel_sizes(cfg, cluster, tp)
        for pp, cp in ((pp, cp) for pp in _divisors(cfg.num_layers) for cp in cps):
            if cluster.gpus % (tp * pp * cp):
                continue
            dp = cluster.gpus // (tp * pp * cp)
            if global_batch_size % (micro_batch_size * dp):
                continue
            gas = global_batch_size // (micro_batch_size * dp)
            eps = [ep for ep in _divisors(cfg.num_experts) if dp * cp % ep == 0] if cfg.num_experts else [1]
            for ep in eps:
                for z in zero:
                    if z >= 2 and pp > 1:
                        continue
                    if cfg.num_experts and z == 3:
                        continue
                    for rc in recompute:
                        base = Layout(tp=tp, pp=pp, dp=dp, ep=ep, cp=cp, zero=z, sequence_parallel=tp > 1, recompute=rc,
                                      micro_batch_size=micro_batch_size, grad_accum=gas, bf16=bf16)
                        out.append(base)
                        if allow_offload and z in (1, 3):  # the shipped offload JSONs
                            out.append(replace(base, offload_optimizer=True))
                            if z == 3:
                                out.append(replace(base, offload_optimizer=True, offload_params=True))
    return out


def context_parallel_sizes(cfg: ModelConfig, cluster: Cluster, tp: int) -> list[int]:
    """CP sizes to consider: 1, and for long sequences powers of two with TP x CP within a node."""
    sizes = [1]
    if cfg.seq_length >= LONG_SEQUENCE and cfg.position_embedding_type == "rope":
        cp = 2
        while tp * cp <= cluster.gpus_per_node and cfg.seq_length % (2 * cp) == 0 and (cfg.seq_length // cp) % tp == 0:
            sizes.append(cp)
            cp *= 2
    return sizes


def step_seconds(cfg: ModelConfig, lay: Layout, cluster: Cluster) -> float:
    """The coarse step time of the module docstring."""
    cfg = replace(cfg, padded_vocab_size=cfg.pad_vocab(lay.tp))
    tokens = lay.micro_batch_size * cfg.seq_length * lay.grad_accum * lay.dp  # per step, whole job
    flops = flops_per_token(cfg) * tokens / lay.world
    attention_share = attention_core_flops_per_token(cfg) / flops_per_token(cfg)
    factor = {"full": 4 / 3, "selective": 1 + attention_share / 3}.get(lay.recompute, 1.0)
    compute = flops * factor / (PEAK_TFLOPS * 1e12 * BASE_MFU)
    bubble = (lay.pp - 1) / lay.grad_accum if lay.pp > 1 else 0.0
    e = 2 if lay.bf16 else 4
    layers = math.ceil(cfg.num_layers / lay.pp)
    local = lay.micro_batch_size * cfg.seq_length / lay.cp  # tokens of a micro-batch on one rank
    tp_bytes = 4 * 2 * (lay.tp - 1) / lay.tp * local * cfg.hidden_size * e
    tp_time = tp_bytes * layers * lay.grad_accum / (NVLINK_GBPS * 1e9) if lay.tp > 1 else 0.0
    dense, expert = stage_parameters(cfg, lay, 0)
    data = lay.data  # gradients are reduced over DP x CP, expert ones over the DP x CP / EP ranks holding them
    expert_dp = data // lay.ep
    dp_bytes = 2 * ((data - 1) / data * dense + (expert_dp - 1) / expert_dp * expert) * e * (1.5 if lay.zero == 3 else 1.0)
    dp_bw = NETWORK_GBPS if lay.tp * lay.pp < cluster.gpus and cluster.gpus > cluster.gpus_per_node else NVLINK_GBPS
    exposed = 0.5 if lay.zero == 2 else 1.0
    dp_time = dp_bytes * exposed / (dp_bw * 1e9) if data > 1 else 0.0
    offload = 16 * (dense + expert) / (OFFLOAD_GBPS * 1e9) if lay.offload_optimizer else 0.0
    return (compute * (1 + bubble) + tp_time + ring_exposed_seconds(cfg, lay, compute * attention_share) + dp_time + offload
            + all_to_all_seconds(cfg, lay, cluster))


def all_to_all_seconds(cfg: ModelConfig, lay: Layout, cluster: Cluster) -> float:
    """The EP term of the module docstring, for the stage with the most MoE layers."""
    if lay.ep == 1 or not cfg.num_experts:
        return 0.0
    e = 2 if lay.bf16 else 4
    moe_layers = max(sum(1 for n in stage if cfg.is_moe_layer(n)) for stage in stage_layers(cfg.num_layers, lay))
    rows = lay.micro_batch_size * cfg.seq_length / lay.cp * cfg.moe_router_topk  # every TP rank sends its CP slice's
    passes = 6 if lay.recompute == "full" else 4  # dispatch and combine, forward and backward (and the recompute)
    volume = passes * rows * cfg.hidden_size * e * (lay.ep - 1) / lay.ep
    bandwidth = NVLINK_GBPS if lay.tp * lay.ep <= cluster.gpus_per_node else NETWORK_GBPS
    return volume * moe_layers * lay.grad_accum / (bandwidth * 1e9)


def ring_traffic_bytes(cfg: ModelConfig, lay: Layout) -> float:
    """Bytes one rank sends around the CP ring per step: each layer's local K/V, CP - 1 hops in
    forward, and in backward CP - 1 hops of K/V plus CP hops of fp32 dK/dV."""
    if lay.cp == 1:
        return 0.0
    e = 2 if lay.bf16 else 4
    kv = 2 * cfg.num_query_groups * cfg.kv_channels / lay.tp * lay.micro_batch_size * cfg.seq_length / lay.cp
    per_layer = kv * e * (lay.cp - 1) * 2 + kv * 4 * lay.cp
    return per_layer * math.ceil(cfg.num_layers / lay.pp) * lay.grad_accum


def ring_exposed_seconds(cfg: ModelConfig, lay: Layout, attention_seconds: float) -> float:
    """The ring's send/recv time beyond the attention compute it overlaps with (within a node)."""
    if lay.cp == 1:
        return 0.0
    return max(0.0, ring_traffic_bytes(cfg, lay) / (NVLINK_GBPS * 1e9) - attention_seconds)


def plan(cfg: ModelConfig, cluster: Cluster, *, micro_batch_size: int, global_batch_size: int, bf16: bool = True,
         backend: str = "cudnn", fused: bool = False, allow_offload: bool = False,
         constrain: Optional[Callable[[Layout], Optional[Layout]]] = None, cp_sizes: Optional[Iterable[int]] = None) -> list[Plan]:
    """Every candidate with its memory and step time, the fitting ones first, fastest first.
    ``constrain`` maps a candidate to the layout to plan (e.g. with a JSON's bucket sizes) or
    to None to drop it."""
    plans = []
    for lay in candidate_layouts(cfg, cluster, micro_batch_size=micro_batch_size, global_batch_size=global_batch_size,
                                 bf16=bf16, allow_offload=allow_offload, cp_sizes=cp_sizes):
        if constrain is not None and (lay := constrain(lay)) is None:
            continue
        memory = estimate(cfg, lay, backend=backend, fused=fused)
        p = Plan(lay, memory, step_seconds(cfg, lay, cluster), fits=False, reserved_gib=cluster.reserved)
        p.fits = p.needed_gib <= cluster.gpu_memory_gib
        plans.append(p)
    # fitting first, then fastest; at equal time the one that leaves more memory free
    plans.sort(key=lambda p: (not p.fits, round(p.step_seconds, 6), p.needed_gib))
    return plans


def recommend(plans: list[Plan]) -> Optional[Plan]:
    return next((p for p in plans if p.fits), None)


def ds_config_for(lay: Layout) -> str:
    if lay.offload_params:
        return "ds_configs/zero3_offload_cpu.json"
    if lay.offload_optimizer:
        return "ds_configs/zero1_offload_cpu.json" if lay.zero == 1 else "ds_configs/zero3_offload_cpu.json"
    return f"ds_configs/zero{lay.zero}.json"


def pretrain_flags(lay: Layout, global_batch_size: int, skip: Iterable[str] = ()) -> list[str]:
    """The layout as scripts/pretrain.py flags, leaving out the flags named in ``skip``."""
    pairs = [("--tensor-model-parallel-size", str(lay.tp)), ("--pipeline-model-parallel-size", str(lay.pp))]
    if lay.cp > 1:
        pairs.append(("--context-parallel-size", str(lay.cp)))
    if lay.ep > 1:
        pairs.append(("--expert-model-parallel-size", str(lay.ep)))
    if lay.sequence_parallel:
        pairs.append(("--sequence-parallel", None))
    if lay.recompute:
        pairs.append(("--recompute-granularity", lay.recompute))
    pairs += [("--micro-batch-size", str(lay.micro_batch_size)), ("--global-batch-size", str(global_batch_size)),
              ("--deepspeed_config", ds_config_for(lay))]
    if lay.bf16:
        pairs.append(("--bf16", None))
    skip = set(skip)
    return [word for flag, value in pairs if flag not in skip for word in ((flag,) if value is None else (flag, value))]
