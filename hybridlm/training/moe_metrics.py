"""MoE routing statistics for the log: per layer, tokens per expert, dropped fraction and aux losses.

Each MoE layer sums its own statistics (``RoutingStats``) over the micro-batches it routed
since the last report. Here they go into one fixed-size table, a row per MoE layer of the
whole model, summed over DP x CP (each DP or CP rank routed different tokens; the aux losses,
identical on the CP ranks of a micro-batch, are summed as often as the micro-batches are
counted) and over PP (each layer lives on one stage), so every rank ends with the whole
model's table. TP ranks hold identical rows (they route the same tokens), so nothing is
summed over TP.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from ..config import RunConfig
from ..parallel.moe import moe_layers


def collect_moe_stats(model: nn.Module, cfg: RunConfig, ps) -> dict | None:
    """The statistics since the last call, averaged per optimizer step (counts) or per
    micro-batch (losses), then reset. Collective: every rank calls it at the same step."""
    m = cfg.model
    if m.num_experts is None:
        return None
    numbers = [i for i in range(m.num_layers) if m.is_moe_layer(i)]
    device = next(model.parameters()).device
    table = torch.zeros(len(numbers), m.num_experts + 5, dtype=torch.float64, device=device)
    for layer in moe_layers(model):
        table[numbers.index(layer.layer_number)] = layer.stats.pop(device)
    for group in (ps.grad_reduction, ps.pp):
        if group.size > 1:
            dist.all_reduce(table, group=group.group)
    table = table.cpu()
    counts, (dropped, assigned, aux, z, micro) = table[:, :m.num_experts], table[:, m.num_experts:].unbind(1)
    micro = micro.clamp_min(1.0)
    steps = micro / (ps.grad_reduction.size * cfg.gradient_accumulation_steps)
    layers = {str(n): {"tokens_per_expert": (counts[i] / steps[i]).tolist(),
                       "dropped_fraction": float(dropped[i] / assigned[i].clamp_min(1.0)),
                       "aux_loss": float(aux[i] / micro[i]), "z_loss": float(z[i] / micro[i])}
              for i, n in enumerate(numbers)}
    return {"aux_loss": float((aux / micro).sum()), "z_loss": float((z / micro).sum()),
            "dropped_fraction": float(dropped.sum() / assigned.sum().clamp_min(1.0)), "layers": layers}


def moe_scalars(moe: dict) -> dict:
    """The routing statistics as the scalar series W&B and TensorBoard chart: per MoE layer its
    dropped fraction, balance loss, the busiest expert's load over the mean (1.0 is perfect
    balance) and each expert's load over the mean."""
    out = {}
    for n, layer in moe["layers"].items():
        load = torch.tensor(layer["tokens_per_expert"], dtype=torch.float64)
        relative = (load / load.mean().clamp_min(1e-30)).tolist()
        out.update({f"moe/layer{n}/dropped_fraction": layer["dropped_fraction"], f"moe/layer{n}/aux_loss": layer["aux_loss"],
                    f"moe/layer{n}/max_load": max(relative)})
        out.update({f"moe/layer{n}/expert{e}_load": value for e, value in enumerate(relative)})
    return out


def tracker_metrics(record: dict) -> dict:
    """A logged step's record for W&B/TensorBoard: numbers only (the per-layer table, which holds
    lists, becomes ``moe_scalars``)."""
    metrics = {k: v for k, v in record.items() if k not in ("iteration", "time", "moe_layers")}
    if "moe_layers" in record:
        metrics.update(moe_scalars({"layers": record["moe_layers"]}))
    return metrics
