"""Candidate layouts for a model on a cluster, a simple step-time model, and the recommendation.

Candidates: TP in {1, 2, 4, 8} within a node (heads, key/value groups and the MLP width
divisible by it), PP dividing the layer count, DP what is left, ZeRO 0-3 (2 and 3 only with
PP = 1, as DeepSpeed's pipeline engine allows), sequence parallelism whenever TP > 1,
recompute none / selective / full; for MoE models EP dividing both the experts and DP.

A layout fits when its planned peak plus headroom (``FRAGMENTATION`` of it for the caching
allocator, plus ``RESERVED_GIB`` for the CUDA context, NCCL and library workspaces, which
``max_memory_allocated`` does not count) is within the GPU's memory.

Step time, to rank the layouts that fit (a coarse model: it orders layouts, it does not
predict seconds; the constants are an H100/H200 node with NVLink and one 400 Gb/s NIC per GPU):

  compute     model FLOPs per GPU / (peak x ``BASE_MFU``), x 4/3 with full recompute (one more
              forward), x (1 + attention-core share / 3) with selective
  bubble      x (1 + (PP - 1) / micro-batches) for 1F1B
  TP          4 all-reduces (or reduce-scatter + all-gather) of the layer's activations per
              layer per micro-batch, over NVLink, not overlapped
  DP          one gradient reduction per step over the network once DP spans nodes (expert
              gradients only over the DP / EP ranks holding the same experts); ZeRO-2
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
from ..training.metrics import flops_per_token
from .memory import GIB, Breakdown, Layout, estimate, stage_layers, stage_parameters

FRAGMENTATION = 0.10
RESERVED_GIB = 2.0
BASE_MFU = 0.45
PEAK_TFLOPS = 989.0
NVLINK_GBPS = 300.0  # per GPU, bytes/s (x 1e9), achievable all-reduce bus bandwidth
NETWORK_GBPS = 40.0  # per GPU across nodes
OFFLOAD_GBPS = 10.0


@dataclass(frozen=True)
class Cluster:
    gpus: int
    gpus_per_node: int = 8
    gpu_memory_gib: float = 80.0


@dataclass
class Plan:
    layout: Layout
    memory: Breakdown
    step_seconds: float
    fits: bool

    @property
    def needed_gib(self) -> float:
        return self.memory.total * (1 + FRAGMENTATION) / GIB + RESERVED_GIB


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidate_layouts(cfg: ModelConfig, cluster: Cluster, *, micro_batch_size: int, global_batch_size: int,
                      bf16: bool = True, recompute: Iterable = (None, "selective", "full"),
                      zero: Iterable[int] = (0, 1, 2, 3), allow_offload: bool = False) -> list[Layout]:
    """Every layout the trainer accepts for this model on ``cluster`` (see the module docstring)."""
    out = []
    for tp in (1, 2, 4, 8):
        if tp > cluster.gpus_per_node or cluster.gpus % tp:
            continue
        if cfg.num_attention_heads % tp or cfg.num_query_groups % tp or cfg.ffn_hidden_size % tp:
            continue
        if cfg.num_experts and cfg.moe_ffn_hidden_size % tp:
            continue
        for pp in _divisors(cfg.num_layers):
            if cluster.gpus % (tp * pp):
                continue
            dp = cluster.gpus // (tp * pp)
            if global_batch_size % (micro_batch_size * dp):
                continue
            gas = global_batch_size // (micro_batch_size * dp)
            eps = [ep for ep in _divisors(cfg.num_experts) if dp % ep == 0] if cfg.num_experts else [1]
            for ep in eps:
                for z in zero:
                    if z >= 2 and pp > 1:
                        continue
                    if cfg.num_experts and z == 3:
                        continue
                    for rc in recompute:
                        base = Layout(tp=tp, pp=pp, dp=dp, ep=ep, zero=z, sequence_parallel=tp > 1, recompute=rc,
                                      micro_batch_size=micro_batch_size, grad_accum=gas, bf16=bf16)
                        out.append(base)
                        if allow_offload and z in (1, 3):  # the shipped offload JSONs
                            out.append(replace(base, offload_optimizer=True))
                            if z == 3:
                                out.append(replace(base, offload_optimizer=True, offload_params=True))
    return out


def step_seconds(cfg: ModelConfig, lay: Layout, cluster: Cluster) -> float:
    """The coarse step time of the module docstring."""
    cfg = replace(cfg, padded_vocab_size=cfg.pad_vocab(lay.tp))
    tokens = lay.micro_batch_size * cfg.seq_length * lay.grad_accum * lay.dp  # per step, whole job
    flops = flops_per_token(cfg) * tokens / lay.world
    attention_share = 12 * cfg.num_layers * cfg.seq_length * cfg.num_attention_heads * cfg.kv_channels / flops_per_token(cfg)
    factor = {"full": 4 / 3, "selective": 1 + attention_share / 3}.get(lay.recompute, 1.0)
    compute = flops * factor / (PEAK_TFLOPS * 1e12 * BASE_MFU)
    bubble = (lay.pp - 1) / lay.grad_accum if lay.pp > 1 else 0.0
    e = 2 if lay.bf16 else 4
    layers = math.ceil(cfg.num_layers / lay.pp)
    tp_bytes = 4 * 2 * (lay.tp - 1) / lay.tp * lay.micro_batch_size * cfg.seq_length * cfg.hidden_size * e
    tp_time = tp_bytes * layers * lay.grad_accum / (NVLINK_GBPS * 1e9) if lay.tp > 1 else 0.0
    dense, expert = stage_parameters(cfg, lay, 0)
    expert_dp = lay.dp // lay.ep
    dp_bytes = 2 * ((lay.dp - 1) / lay.dp * dense + (expert_dp - 1) / expert_dp * expert) * e * (1.5 if lay.zero == 3 else 1.0)
    dp_bw = NETWORK_GBPS if lay.tp * lay.pp < cluster.gpus and cluster.gpus > cluster.gpus_per_node else NVLINK_GBPS
    exposed = 0.5 if lay.zero == 2 else 1.0
    dp_time = dp_bytes * exposed / (dp_bw * 1e9) if lay.dp > 1 else 0.0
    offload = 16 * (dense + expert) / (OFFLOAD_GBPS * 1e9) if lay.offload_optimizer else 0.0
    return compute * (1 + bubble) + tp_time + dp_time + offload + all_to_all_seconds(cfg, lay, cluster)


def all_to_all_seconds(cfg: ModelConfig, lay: Layout, cluster: Cluster) -> float:
    """The EP term of the module docstring, for the stage with the most MoE layers."""
    if lay.ep == 1 or not cfg.num_experts:
        return 0.0
    e = 2 if lay.bf16 else 4
    moe_layers = max(sum(1 for n in stage if cfg.is_moe_layer(n)) for stage in stage_layers(cfg.num_layers, lay.pp))
    rows = lay.micro_batch_size * cfg.seq_length * cfg.moe_router_topk  # every TP rank sends the whole micro-batch's
    passes = 6 if lay.recompute == "full" else 4  # dispatch and combine, forward and backward (and the recompute)
    volume = passes * rows * cfg.hidden_size * e * (lay.ep - 1) / lay.ep
    bandwidth = NVLINK_GBPS if lay.tp * lay.ep <= cluster.gpus_per_node else NETWORK_GBPS
    return volume * moe_layers * lay.grad_accum / (bandwidth * 1e9)


def plan(cfg: ModelConfig, cluster: Cluster, *, micro_batch_size: int, global_batch_size: int, bf16: bool = True,
         backend: str = "cudnn", fused: bool = False, allow_offload: bool = False,
         constrain: Optional[Callable[[Layout], Optional[Layout]]] = None) -> list[Plan]:
    """Every candidate with its memory and step time, the fitting ones first, fastest first.
    ``constrain`` maps a candidate to the layout to plan (e.g. with a JSON's bucket sizes) or
    to None to drop it."""
    plans = []
    for lay in candidate_layouts(cfg, cluster, micro_batch_size=micro_batch_size, global_batch_size=global_batch_size,
                                 bf16=bf16, allow_offload=allow_offload):
        if constrain is not None and (lay := constrain(lay)) is None:
            continue
        memory = estimate(cfg, lay, backend=backend, fused=fused)
        p = Plan(lay, memory, step_seconds(cfg, lay, cluster), fits=False)
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
