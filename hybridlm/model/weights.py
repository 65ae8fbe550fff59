"""Layout-independent weights: initialise from the seed, load a full state dict into any
layout, gather any layout back into a full state dict.

A parameter's full value is drawn from a generator seeded by (seed, the parameter's
name), then sliced with the parameter's ``tp_sharding``. Names are the same at every
TP/PP (see ``specs``), so the same seed gives the same full model on any layout, and
the values do not depend on which rank or stage builds them or in what order.
"""
from __future__ import annotations

import hashlib

import torch
import torch.distributed as dist
from torch import nn

from ..parallel.state import GroupHandle


def _param_seed(seed: int, name: str) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}/{name}".encode()).digest()[:8], "little") & ((1 << 63) - 1)


def _full_shape(param: nn.Parameter, tp: GroupHandle) -> tuple:
    sharding = getattr(param, "tp_sharding", None)
    return tuple(param.shape) if sharding is None else sharding.full_shape(param.shape, tp.size)


def _to_local(param: nn.Parameter, full: torch.Tensor, tp: GroupHandle) -> torch.Tensor:
    sharding = getattr(param, "tp_sharding", None)
    return full if sharding is None else sharding.shard(full, tp.rank, tp.size)


@torch.no_grad()
def init_parameters(model: nn.Module, seed: int, tp: GroupHandle) -> None:
    for name, param in model.named_parameters():
        std, value = getattr(param, "init_std", None), getattr(param, "init_value", None)
        if std is None and value is None:
            raise RuntimeError(f"parameter {name} has no initialisation rule (was it created outside the ParallelPlan?)")
        shape = _full_shape(param, tp)
        if std is not None:
            generator = torch.Generator(device=param.device).manual_seed(_param_seed(seed, name))
            full = torch.empty(shape, device=param.device, dtype=torch.float32).normal_(0.0, std, generator=generator)
        else:
            full = torch.full(shape, value, device=param.device, dtype=torch.float32)
        param.copy_(_to_local(param, full, tp))


@torch.no_grad()
def load_full_state_dict(model: nn.Module, full: dict[str, torch.Tensor], tp: GroupHandle) -> None:
    """Copy the matching slice of each full tensor into this rank's parameters."""
    for name, param in model.named_parameters():
        if name not in full:
            raise KeyError(f"the state dict has no tensor for parameter {name}")
        tensor = full[name]
        if tuple(tensor.shape) != _full_shape(param, tp):
            raise ValueError(f"{name}: full shape {tuple(tensor.shape)} does not match the model's {_full_shape(param, tp)}")
        param.copy_(_to_local(param, tensor.to(param.device, param.dtype), tp))


def gather_full_state_dict(local: dict[str, torch.Tensor], model: nn.Module, tp: GroupHandle, dp: GroupHandle) -> dict:
    """Assemble full tensors from every rank's ``local`` {name: shard} (e.g. weights or gradients).

    Every rank must call it; every rank gets the full dict. Meant for tests and small models:
    it moves everything through ``all_gather_object``.
    """
    shardings = {name: getattr(p, "tp_sharding", None) for name, p in model.named_parameters()}
    mine = {"tp_rank": tp.rank, "dp_rank": dp.rank,
            "tensors": {k: (v.detach().float().cpu().clone(), shardings[k]) for k, v in local.items()}}
    if not dist.is_initialized() or dist.get_world_size() == 1:
        everyone = [mine]
    else:
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
    pieces: dict[str, dict[int, tuple]] = {}
    for entry in everyone:
        if entry["dp_rank"] != 0:
            continue
        for name, (tensor, sharding) in entry["tensors"].items():
            pieces.setdefault(name, {})[entry["tp_rank"]] = (tensor, sharding)
    full = {}
    for name, by_rank in pieces.items():
        ordered = [by_rank[r] for r in sorted(by_rank)]
        sharding = ordered[0][1]
        full[name] = ordered[0][0] if sharding is None else sharding.unshard([t for t, _ in ordered])
    return full
