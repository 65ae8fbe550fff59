"""Layout-independent weights: initialise from the seed, load a full state dict into any
layout, gather any layout back into a full state dict.

A parameter's full value is drawn from a generator seeded by (seed, the parameter's
name), then sliced with the parameter's ``tp_sharding`` (over the TP group) and, for
stacked expert weights, its ``ep_sharding`` (experts split over the EP group, dim 0).
Names are the same at every TP/PP/EP (see ``specs``), so the same seed gives the same
full model on any layout, and the values do not depend on which rank or stage builds
them or in what order. Vocabulary padding (whose size depends on TP) is the exception that
keeps the rule: a tensor marked with ``mark_vocabulary_rows`` draws only its real rows and
starts its padding rows at zero, so the real rows never depend on how much padding there is.
"""
from __future__ import annotations

import hashlib

import torch
import torch.distributed as dist
from torch import nn

from ..parallel.quantized import quantized_weights
from ..parallel.state import SINGLE, GroupHandle


def _param_seed(seed: int, name: str) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}/{name}".encode()).digest()[:8], "little") & ((1 << 63) - 1)


def _shardings(param: nn.Parameter) -> tuple:
    return getattr(param, "tp_sharding", None), getattr(param, "ep_sharding", None)


def _full_shape(param: nn.Parameter, tp: GroupHandle, ep: GroupHandle = SINGLE) -> tuple:
    shape = tuple(param.shape)
    for sharding, group in zip(_shardings(param), (tp, ep)):
        if sharding is not None:
            shape = sharding.full_shape(shape, group.size)
    return shape


def _to_local(param: nn.Parameter, full: torch.Tensor, tp: GroupHandle, ep: GroupHandle = SINGLE) -> torch.Tensor:
    for sharding, group in zip(_shardings(param), (tp, ep)):
        if sharding is not None:
            full = sharding.shard(full, group.rank, group.size)
    return full


def mark_vocabulary_rows(param: nn.Parameter, vocab_size: int | None) -> None:
    """Say that the first ``vocab_size`` rows of ``param``'s full tensor are the vocabulary and
    the rest padding (zero at initialisation; the loss leaves their logits out)."""
    param.vocab_rows = vocab_size


@torch.no_grad()
def init_parameters(model: nn.Module, seed: int, tp: GroupHandle, ep: GroupHandle = SINGLE) -> None:
    """Every parameter from the seed; a 4-bit base's weights (QLoRA) are quantized from their full initial value."""
    for name, param in model.named_parameters():
        param.copy_(initial_value(name, param, seed, tp, ep))
    for name, weight in quantized_weights(model):
        weight.assign(full_initial_value(name, weight, seed, tp, ep))


def initial_value(name: str, param: nn.Parameter, seed: int, tp: GroupHandle, ep: GroupHandle = SINGLE) -> torch.Tensor:
    """This rank's slice of the parameter's initial value (fp32): normal(0, ``init_std``), uniform
    within +-``init_bound`` (LoRA's A, as Kaiming's), or the constant ``init_value``."""
    return _to_local(param, full_initial_value(name, param, seed, tp, ep), tp, ep)


def full_initial_value(name: str, param, seed: int, tp: GroupHandle, ep: GroupHandle = SINGLE) -> torch.Tensor:
    """The full (single-process) initial value of ``param`` (anything with its shape, device, sharding
    tags and initialisation rule), fp32."""
    std, bound, value = (getattr(param, key, None) for key in ("init_std", "init_bound", "init_value"))
    if std is None and bound is None and value is None:
        raise RuntimeError(f"parameter {name} has no initialisation rule (was it created outside the LayerFactory?)")
    shape = _full_shape(param, tp, ep)
    if std is None and bound is None:
        full = torch.full(shape, value, device=param.device, dtype=torch.float32)
    else:
        generator = torch.Generator(device=param.device).manual_seed(_param_seed(seed, name))
        rows = getattr(param, "vocab_rows", None) or shape[0]
        full = torch.zeros(shape, device=param.device, dtype=torch.float32)
        if std is not None:
            full[:rows].normal_(0.0, std, generator=generator)
        else:
            full[:rows].uniform_(-bound, bound, generator=generator)
    return full


@torch.no_grad()
def load_full_state_dict(model: nn.Module, full: dict[str, torch.Tensor], tp: GroupHandle, ep: GroupHandle = SINGLE) -> None:
    """Copy the matching slice of each full tensor into this rank's parameters."""
    for name, param in model.named_parameters():
        if name not in full:
            raise KeyError(f"the state dict has no tensor for parameter {name}")
        tensor = full[name]
        if tuple(tensor.shape) != _full_shape(param, tp, ep):
            raise ValueError(f"{name}: full shape {tuple(tensor.shape)} does not match the model's {_full_shape(param, tp, ep)}")
        param.copy_(_to_local(param, tensor.to(param.device, param.dtype), tp, ep))


def gather_full_state_dict(local: dict[str, torch.Tensor], model: nn.Module, tp: GroupHandle, dp: GroupHandle,
                           ep: GroupHandle = SINGLE) -> dict:
    """Assemble full tensors from every rank's ``local`` {name: shard} (e.g. weights or gradients).

    Dense tensors come from DP rank 0; expert tensors from the first EP group of the DP
    group (DP ranks 0..EP-1: EP groups are consecutive chunks of DP), one EP rank each.
    Pass ``ps.grad_reduction`` as ``dp`` (DP x CP under context parallelism: CP ranks hold replicas).
    Every rank must call it; every rank gets the full dict. Meant for tests and small models:
    it moves everything through ``all_gather_object`` (``shard_entry`` and ``assemble_full``
    do the same through files, for models too large to pickle between ranks).
    """
    mine = shard_entry(local, model, tp, dp, ep)
    if not dist.is_initialized() or dist.get_world_size() == 1:
        everyone = [mine]
    else:
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
    return assemble_full(everyone)


def _first_replica(dp_rank: int, ep_size: int, expert: bool) -> bool:
    """Whether this DP rank's copy is the one a full tensor is assembled from (see ``gather_full_state_dict``)."""
    return dp_rank < ep_size if expert else dp_rank == 0


def shard_entry(local: dict[str, torch.Tensor], model: nn.Module, tp: GroupHandle, dp: GroupHandle,
                ep: GroupHandle = SINGLE) -> dict:
    """This rank's part of a full state dict, with what ``assemble_full`` needs to place it (fp32 on the host); a
    replica that ``assemble_full`` would ignore carries no tensors."""
    shardings = {name: _shardings(p) for name, p in model.named_parameters()}
    tensors = {k: (v.detach().float().cpu().clone(), shardings[k]) for k, v in local.items()
               if _first_replica(dp.rank, ep.size, shardings[k][1] is not None)}
    return {"tp_rank": tp.rank, "dp_rank": dp.rank, "ep_rank": ep.rank, "ep_size": ep.size, "tensors": tensors}


def assemble_full(entries: list[dict]) -> dict:
    """Full tensors from every rank's ``shard_entry`` (in any order)."""
    pieces: dict[str, dict[tuple, tuple]] = {}
    for entry in entries:
        for name, (tensor, (tp_sharding, ep_sharding)) in entry["tensors"].items():
            if _first_replica(entry["dp_rank"], entry["ep_size"], ep_sharding is not None):
                pieces.setdefault(name, {})[(entry["ep_rank"], entry["tp_rank"])] = (tensor, tp_sharding, ep_sharding)
    full = {}
    for name, by_rank in pieces.items():
        _, tp_sharding, ep_sharding = next(iter(by_rank.values()))
        per_ep = []
        for ep_rank in sorted({e for e, _ in by_rank}):
            shards = [by_rank[(e, t)][0] for e, t in sorted(by_rank) if e == ep_rank]
            per_ep.append(shards[0] if tp_sharding is None else tp_sharding.unshard(shards))
        full[name] = per_ep[0] if ep_sharding is None else ep_sharding.unshard(per_ep)
    return full
