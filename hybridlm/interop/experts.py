"""Expert weights in files of their own, one per (stage, TP rank, EP rank).

DeepSpeed writes the model states from data-parallel rank 0 only, so with EP > 1 its files hold
EP rank 0's experts and a resume would hand the other EP ranks the wrong ones. At every save
the first data-parallel replica of each EP rank also writes its experts here, and a resume at
the same layout puts them back after DeepSpeed's own load (the fp32 master copies and Adam
moments are right already: DeepSpeed's optimizer files are per rank). The reader and reshape
take expert weights from these files too.
"""
from __future__ import annotations

import os

import torch
from torch import nn

from .layout import Layout, atomic_torch_save, load_file


def expert_parameters(module: nn.Module) -> dict[str, nn.Parameter]:
    return {name: p for name, p in module.named_parameters() if getattr(p, "ep_sharding", None) is not None}


def save_expert_weights(module: nn.Module, tag_dir: str, layout: Layout, ps) -> None:
    """Called on every rank; the ranks of the first EP group of each data-parallel (DP x CP) group write."""
    experts = expert_parameters(module)
    if not experts or ps.grad_reduction.rank >= ps.ep.size:
        return
    path = layout.expert_file(tag_dir, ps.pp.rank, ps.tp.rank, ps.ep.rank)
    atomic_torch_save({name: p.detach().cpu().clone() for name, p in experts.items()}, path)


@torch.no_grad()
def load_expert_weights(module: nn.Module, tag_dir: str, layout: Layout, ps) -> bool:
    """Put this rank's own experts back; False when the checkpoint has no file for them."""
    experts = expert_parameters(module)
    path = layout.expert_file(tag_dir, ps.pp.rank, ps.tp.rank, ps.ep.rank)
    if not experts or not os.path.isfile(path):
        return False
    saved = load_file(path, mmap=False)
    for name, param in experts.items():
        param.copy_(saved[name].to(param.device, param.dtype))
    return True
