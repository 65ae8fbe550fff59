"""Full tensors -> a weights-only checkpoint folder at a chosen TP/PP/EP, in DeepSpeed's file layout.

    PP = 1   mp_rank_<tp>_model_states.pt            {"module": this TP rank's state dict, ...}
    PP > 1   layer_<i>-model_<tp>-model_states.pt     one file per layer spec and TP rank (the tied
             mp_rank_<stage, tp>_model_states.pt      head is not saved, as DeepSpeed does)
    experts  experts_ep_rank_<e>_mp_rank_<stage, tp>.pt
    plus hybridlm_checkpoint.json (optimizer_state: false), config.yaml, and ``latest``

``pretrain.py --load`` reads such a folder through ``hybridlm.interop.reshape`` at any layout
(weights only: fresh optimizer, iteration 0). Files are written one (stage, TP rank) or one layer
at a time, so memory holds one file's tensors; everything goes to a temporary directory that is
renamed into place at the end.
"""
from __future__ import annotations

import json
import os
import shutil
from collections import OrderedDict
from dataclasses import asdict
from typing import Callable, Iterable

import torch

from ..config import RunConfig, effective_yaml
from .layout import CONFIG_FILE, FORMAT_VERSION, INFO_FILE, Layout, ParamInfo, parameter_table

TAG = "global_step0"


def stage_of_layers(cfg, pp: int) -> list[int]:
    """Spec index -> pipeline stage, as DeepSpeed's ``partition_method="type:TransformerLayer"`` assigns them."""
    from deepspeed.runtime.utils import partition_balanced
    specs = cfg.num_layers + 3  # embedding, layers, final norm, head
    weights = [1 if 1 <= i <= cfg.num_layers else 0 for i in range(specs)]
    parts = partition_balanced(weights=weights, num_parts=pp)
    return [next(s for s in range(pp) if parts[s] <= i < parts[s + 1]) for i in range(specs)]


def _local(full: torch.Tensor, info: ParamInfo, tp_rank: int, tp: int, ep_rank: int, ep: int) -> torch.Tensor:
    if info.tp_sharding is not None:
        full = info.tp_sharding.shard(full, tp_rank, tp)
    if info.ep_sharding is not None:
        full = info.ep_sharding.shard(full, ep_rank, ep)
    return full.contiguous().clone()


def write_checkpoint(output: str, run: RunConfig, full_tensor: Callable[[str], torch.Tensor],
                     progress: Callable[[Iterable], Iterable] = lambda x: x, *, tokenizer_known: bool = True) -> list[str]:
    """Write ``output`` (a new run directory) from ``full_tensor(name)`` at ``run``'s layout. Returns the files."""
    layout = Layout.of_run(run)
    table = parameter_table(run.model, layout.tp, layout.ep)
    stages = stage_of_layers(run.model, layout.pp)
    staging = f"{output.rstrip(os.sep)}.partial-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    tag_dir = os.path.join(staging, TAG)
    os.makedirs(tag_dir)
    header = {"buffer_names": [], "optimizer": None, "param_shapes": None, "lr_scheduler": None, "skipped_steps": 0,
              "global_steps": 0, "global_samples": 0, "dp_world_size": layout.data_ranks, "mp_world_size": layout.tp * layout.pp,
              "checkpoint_parallel_dimensions": {"pp_degree": layout.pp, "tp_degree": layout.tp}, "iteration": 0,
              "consumed_samples": 0}
    try:
        files = _write_tensors(tag_dir, layout, table, stages, full_tensor, progress, header)
        info = {"format_version": FORMAT_VERSION, "iteration": 0, "layout": asdict(layout), "optimizer_state": False,
                "expert_files": run.model.num_experts is not None, "tokenizer": tokenizer_known}
        for directory in (tag_dir, staging):
            with open(os.path.join(directory, CONFIG_FILE), "w") as f:
                f.write(effective_yaml(run))
        with open(os.path.join(tag_dir, INFO_FILE), "w") as f:
            json.dump(info, f, indent=2)
        with open(os.path.join(staging, "latest"), "w") as f:
            f.write(TAG)
        if os.path.isdir(output):
            os.rmdir(output)  # an empty directory (the caller refuses anything else)
        os.replace(staging, output)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return files


def _write_tensors(tag_dir, layout: Layout, table: dict[str, ParamInfo], stages: list[int], full_tensor, progress,
                   header: dict) -> list[str]:
    """One pass per (stage, TP rank): memory holds that rank's files and one full tensor at a time."""
    files = []
    by_spec: "OrderedDict[int, list[str]]" = OrderedDict()
    for name in table:
        by_spec.setdefault(0 if name.startswith("tied_modules.") else int(name.split(".", 1)[0]), []).append(name)
    passes = [(stage, tp_rank) for stage in range(layout.pp) for tp_rank in range(layout.tp)]
    for stage, tp_rank in progress(passes):
        module, experts = OrderedDict(), [dict() for _ in range(layout.ep)]
        for spec, names in by_spec.items():
            if layout.pp > 1 and stages[spec] != stage:
                continue
            layer = OrderedDict()
            for name in names:
                full, info = full_tensor(name), table[name]
                # experts: EP rank 0's slice in the model states, as DeepSpeed saves them; every EP rank's in its own file
                layer[_key_in_file(name, layout.pp)] = _local(full, info, tp_rank, layout.tp, 0, layout.ep)
                if info.is_expert:
                    for ep_rank in range(layout.ep):
                        experts[ep_rank][name] = _local(full, info, tp_rank, layout.tp, ep_rank, layout.ep)
            if layout.pp > 1:
                file = f"layer_{spec:02d}-model_{tp_rank:02d}-model_states.pt"
                torch.save(layer, os.path.join(tag_dir, file))
                files.append(file)
            else:
                module.update(layer)
        file = f"mp_rank_{layout.mp_rank(stage, tp_rank):02d}_model_states.pt"  # PP > 1: bookkeeping only, as DeepSpeed's
        torch.save({"module": module if layout.pp == 1 else None, **header}, os.path.join(tag_dir, file))
        files.append(file)
        for ep_rank, states in enumerate(experts):
            if states:
                path = layout.expert_file(tag_dir, stage, tp_rank, ep_rank)
                torch.save(states, path)
                files.append(os.path.basename(path))
    return files


def _key_in_file(name: str, pp: int) -> str:
    """DeepSpeed's layer files key parameters relative to their layer (the tied embedding to its module)."""
    if pp == 1:
        return name
    return name[len("tied_modules.embed."):] if name.startswith("tied_modules.") else name.split(".", 1)[1]
