"""Full tensors out of DeepSpeed's checkpoint files, for any layout, without launching processes.

Where a parameter's TP/EP-local value lives depends on how the run was laid out:

    model weights   ZeRO 0-2: ``mp_rank_XX_model_states.pt['module']`` (PP=1, or PP with MoE) or
                    ``layer_XX-model_YY-model_states.pt`` (PP>1); ZeRO-3: only in the optimizer
                    partitions below; experts: our ``experts_ep_rank_EE_mp_rank_XX.pt``
    fp32 + Adam     ZeRO-1/2 and bf16 (DeepSpeed's BF16_Optimizer): ``[bf16_]zero_pp_rank_D_mp_rank_XX_optim_states.pt``,
                    flat partitions over DP (over expert-DP for expert groups), each rank's file
                    mapping parameter names to its fragment (``param_slice_mappings``);
                    ZeRO-3: the same files, each parameter split evenly over DP, in the order of
                    ``param_shapes``; ZeRO-0 fp32: a torch optimizer state dict in the model
                    states file (``expp_rank_E_...`` per EP rank with MoE), keyed by the
                    ``param_names`` our optimizer records

where XX is DeepSpeed's model-parallel rank (stage x TP + TP rank). The reader gathers the
local pieces of one parameter at a time and joins them with the parameter's own sharding tags,
so memory holds one parameter (files are memory-mapped), and the same code serves export,
reshape and generation.
"""
from __future__ import annotations

import os
import re
from typing import Callable, Iterator, Optional

import torch

from ..config import ConfigError
from .layout import CheckpointInfo, ParamInfo, load_file, parameter_table, read_info

OPTIMIZER_KEYS = ("fp32", "exp_avg", "exp_avg_sq")
_LAYER_FILE = re.compile(r"^layer_(\d+)-model_(\d+)-model_states\.pt$")
_MODULE_FILE = re.compile(r"^mp_rank_(\d+)_model_states\.pt$")


class OptimizerStateUnavailable(Exception):
    """The checkpoint's optimizer state cannot be read into per-parameter tensors; the message says why."""


class CheckpointReader:
    def __init__(self, tag_dir: str, flag: str = "--checkpoint"):
        self.tag_dir, self.flag = tag_dir, flag
        self.info: CheckpointInfo = read_info(tag_dir, flag)
        self.layout = self.info.layout
        self.model_config = self.info.model_config()
        self.params: dict[str, ParamInfo] = parameter_table(self.model_config, self.layout.tp, self.layout.ep)
        self._files: dict[str, object] = {}
        self._module_index: Optional[dict] = None
        self._flat_index: dict[int, dict] = {}  # ZeRO-3: model-parallel rank -> where each parameter's partitions lie
        self._stage_of: Optional[dict[str, int]] = None

    # ---------------------------------------------------------------- public
    def names(self) -> list[str]:
        return list(self.params)

    def weight(self, name: str) -> torch.Tensor:
        """The full (single-process) value of a parameter, in the dtype it was saved in."""
        if self.layout.zero_stage == 3:  # ZeRO-3's module files hold placeholders: the fp32 partitions are the weights
            return self._assemble(name, lambda e, t: self._flat_local(name, "fp32", e, t))
        return self._assemble(name, lambda e, t: self._module_local(name, e, t))

    def weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name in self.params:
            yield name, self.weight(name)

    def buffer(self, name: str) -> Optional[torch.Tensor]:
        """A saved persistent buffer (replicated on every rank: the expert bias of auxiliary-loss-free
        routing), or None when the checkpoint has none of that name (saved without it)."""
        if self._module_index is None:
            self._module_index = self._index_modules()
        if (0, 0) not in self._module_index.get(name, {}):
            return None
        return self._module_local(name, 0, 0).detach()

    def optimizer_state(self, name: str) -> dict[str, torch.Tensor]:
        """{fp32, exp_avg, exp_avg_sq}: full fp32 tensors. Raises OptimizerStateUnavailable."""
        self._check_optimizer_readable()
        if self._uses_torch_optimizer():
            out = {"fp32": self.weight(name).float()}
            for key in ("exp_avg", "exp_avg_sq"):
                out[key] = self._assemble(name, lambda e, t, k=key: self._torch_local(name, k, e, t))
            return out
        return {key: self._assemble(name, lambda e, t, k=key: self._flat_local(name, k, e, t)) for key in OPTIMIZER_KEYS}

    def optimizer_step(self) -> int:
        """Adam's step count (its bias correction), the same for every parameter."""
        self._check_optimizer_readable()
        if self._uses_torch_optimizer():
            state = self._torch_state(0, 0)["state"]
        else:
            osd = self._file(self._zero_file(0, 0))["optimizer_state_dict"]
            state = (osd["optimizer_state_dict"] if self.layout.zero_stage == 3 else osd["base_optimizer_state"])["state"]
        if not state:
            return 0
        step = next(iter(state.values()))["step"]
        return int(step.item() if torch.is_tensor(step) else step)

    def client_state(self) -> dict:
        """What the trainer stored with the checkpoint (iteration, consumed samples, LR schedule, ...)."""
        states = self._file(self._states_file(0, 0))
        skip = {"module", "optimizer", "param_shapes", "frozen_param_shapes", "frozen_param_fragments", "shared_params",
                "buffer_names", "ds_config"}
        return {k: v for k, v in states.items() if k not in skip}

    # ---------------------------------------------------------------- assembly
    def _assemble(self, name: str, local: Callable[[int, int], torch.Tensor]) -> torch.Tensor:
        if name not in self.params:
            raise ConfigError(f"{self.flag} {self.tag_dir}: the saved model has no parameter {name}.")
        info = self.params[name]
        per_ep = []
        for ep_rank in range(self.layout.ep if info.is_expert else 1):
            shards = []
            for tp_rank in range(self.layout.tp if info.tp_sharding else 1):
                shard = local(ep_rank, tp_rank)
                if shard.numel() != _numel(info.local_shape):
                    raise ConfigError(f"{self.flag} {self.tag_dir}: {name} of TP rank {tp_rank}, EP rank {ep_rank} has shape "
                                      f"{tuple(shard.shape)}, but the saved model's slice is {info.local_shape}.")
                shards.append(shard.reshape(info.local_shape))
            per_ep.append(info.tp_sharding.unshard(shards) if info.tp_sharding else shards[0])
        full = (info.ep_sharding.unshard(per_ep) if info.is_expert else per_ep[0]).detach()
        if tuple(full.shape) != info.full_shape:
            raise ConfigError(f"{self.flag} {self.tag_dir}: {name} assembles to shape {tuple(full.shape)}, "
                              f"but the saved model's is {info.full_shape}.")
        return full

    def _file(self, path: str):
        if path not in self._files:
            self._files[path] = load_file(path)
        return self._files[path]

    def _missing(self, what: str):
        return ConfigError(f"{self.flag} {self.tag_dir}: {what} is missing; the checkpoint is incomplete.")

    # ---------------------------------------------------------------- module weights
    def _states_file(self, pp_rank: int, tp_rank: int, dp_rank: int = 0) -> str:
        mp = self.layout.mp_rank(pp_rank, tp_rank)
        if self.layout.zero_stage == 3:
            return os.path.join(self.tag_dir, f"zero_pp_rank_{dp_rank}_mp_rank_{mp:02d}_model_states.pt")
        return os.path.join(self.tag_dir, f"mp_rank_{mp:02d}_model_states.pt")

    def _module_local(self, name: str, ep_rank: int, tp_rank: int) -> torch.Tensor:
        if self._module_index is None:
            self._module_index = self._index_modules()
        where = self._module_index.get(name, {}).get((ep_rank, tp_rank))
        if where is None:
            raise self._missing(f"{name} (TP rank {tp_rank}, EP rank {ep_rank})")
        path, section, key = where
        contents = self._file(path)
        return (contents[section] if section else contents)[key]

    def _index_modules(self) -> dict:
        """name -> {(ep rank, tp rank): (file, section, key)} over every file that holds model weights."""
        lay, index = self.layout, {}
        self._check_no_extra_files()

        def add(name, ep_rank, tp_rank, path, section, key):
            index.setdefault(name, {}).setdefault((ep_rank, tp_rank), (path, section, key))  # the first stage's copy wins

        for pp_rank in range(lay.pp):
            for tp_rank in range(lay.tp):
                path = self._states_file(pp_rank, tp_rank)
                if not os.path.isfile(path):
                    raise self._missing(os.path.basename(path))
                for key in self._file(path).get("module") or {}:
                    add(key, 0, tp_rank, path, "module", key)
        tied = not self.model_config.untie_embeddings_and_output_weights
        if any(_LAYER_FILE.match(entry) for entry in os.listdir(self.tag_dir)):  # PP > 1: one file per layer and TP rank
            specs = sorted({0 if n.startswith("tied_modules.") else int(n.split(".", 1)[0]) for n in self.params})
            for spec in specs:
                for tp_rank in range(lay.tp):
                    entry = f"layer_{spec:02d}-model_{tp_rank:02d}-model_states.pt"
                    if not os.path.isfile(os.path.join(self.tag_dir, entry)):
                        raise self._missing(entry)
        for entry in sorted(os.listdir(self.tag_dir)):
            match = _LAYER_FILE.match(entry)
            if match:
                layer, tp_rank = int(match.group(1)), int(match.group(2))
                prefix = "tied_modules.embed." if tied and layer == 0 else f"{layer}."
                path = os.path.join(self.tag_dir, entry)
                for key in self._file(path):
                    add(prefix + key, 0, tp_rank, path, None, key)
        if self.info.expert_files:
            for pp_rank in range(lay.pp):
                for tp_rank in range(lay.tp):
                    for ep_rank in range(lay.ep):
                        path = lay.expert_file(self.tag_dir, pp_rank, tp_rank, ep_rank)
                        if not os.path.isfile(path):
                            if any(p.is_expert for p in self.params.values()):
                                raise self._missing(os.path.basename(path))
                            continue
                        for key in self._file(path):
                            index.setdefault(key, {})[(ep_rank, tp_rank)] = (path, None, key)  # not EP rank 0's copy
        return index

    def _check_no_extra_files(self) -> None:
        """A model file of a TP rank or stage the layout does not have means the folder is not what it says."""
        lay = self.layout
        for entry in os.listdir(self.tag_dir):
            match = _MODULE_FILE.match(entry) or _LAYER_FILE.match(entry)
            if match is None:
                continue
            if _MODULE_FILE.match(entry):
                bad = int(match.group(1)) >= lay.tp * lay.pp
            else:
                bad = int(match.group(2)) >= lay.tp or int(match.group(1)) > self.model_config.num_layers + 2
            if bad:
                raise ConfigError(f"{self.flag} {self.tag_dir}: unexpected file {entry} for a checkpoint saved at "
                                  f"{lay.describe()}; the folder mixes checkpoints of different layouts.")

    # ---------------------------------------------------------------- optimizer state
    def _uses_torch_optimizer(self) -> bool:
        return self.layout.zero_stage == 0 and not (self.layout.bf16 or self.layout.fp16)

    def _check_optimizer_readable(self) -> None:
        if not self.info.optimizer_state:
            raise OptimizerStateUnavailable("the checkpoint holds model weights only")
        if self.layout.zero_stage == 0 and self.layout.fp16:
            raise OptimizerStateUnavailable("fp16 without ZeRO keeps its optimizer in a format this reader does not take apart")

    def _torch_state(self, pp_rank: int, ep_rank: int, tp_rank: int = 0) -> dict:
        mp = self.layout.mp_rank(pp_rank, tp_rank)
        has_experts = any(p.is_expert for p in self.params.values())
        path = (os.path.join(self.tag_dir, f"expp_rank_{ep_rank}_mp_rank_{mp:02d}_optim_states.pt") if has_experts
                else self._states_file(pp_rank, tp_rank))
        if not os.path.isfile(path):
            raise self._missing(os.path.basename(path))
        optimizer = self._file(path).get("optimizer")
        if not optimizer or any("param_names" not in g for g in optimizer["param_groups"]):
            raise OptimizerStateUnavailable(f"{os.path.basename(path)} does not name its optimizer's parameters "
                                            "(saved before hybridlm recorded them)")
        return optimizer

    def _torch_local(self, name: str, key: str, ep_rank: int, tp_rank: int) -> torch.Tensor:
        for pp_rank in range(self.layout.pp):
            optimizer = self._torch_state(pp_rank, ep_rank, tp_rank)
            for group in optimizer["param_groups"]:
                if name in group["param_names"]:
                    index = group["params"][group["param_names"].index(name)]
                    state = optimizer["state"].get(index)
                    if state is None:  # never stepped: Adam's moments start at zero
                        return torch.zeros(self.params[name].local_shape)
                    return state[key]
        raise self._missing(f"optimizer state of {name}")

    def _zero_file(self, dp_rank: int, mp_rank: int) -> str:
        prefix = "bf16_" if self.layout.bf16 else ""
        return os.path.join(self.tag_dir, f"{prefix}zero_pp_rank_{dp_rank}_mp_rank_{mp_rank:02d}_optim_states.pt")

    def _stage(self, name: str) -> int:
        """The first pipeline stage whose optimizer holds ``name``."""
        if self.layout.pp == 1:
            return 0
        if self._stage_of is None:
            self._stage_of = {}
            for pp_rank in reversed(range(self.layout.pp)):  # reversed: the first stage's entry is written last
                mp = self.layout.mp_rank(pp_rank, 0)
                for dp_rank in range(self.layout.data_ranks):  # each rank's mapping names only the parameters in its partition
                    path = self._zero_file(dp_rank, mp)
                    if not os.path.isfile(path):
                        raise self._missing(os.path.basename(path))
                    for group in self._file(path)["optimizer_state_dict"]["param_slice_mappings"]:
                        for key in group:
                            self._stage_of[key] = pp_rank
        if name not in self._stage_of:
            raise self._missing(f"optimizer state of {name}")
        return self._stage_of[name]

    def _flat_local(self, name: str, key: str, ep_rank: int, tp_rank: int) -> torch.Tensor:
        if self.layout.zero_stage == 3:
            return self._zero3_local(name, key, tp_rank)
        mp = self.layout.mp_rank(self._stage(name), tp_rank)
        expert = self.params[name].is_expert
        pieces = []
        for dp_rank in range(self.layout.data_ranks):
            if expert and dp_rank % self.layout.ep != ep_rank:
                continue  # expert groups are partitioned over the ranks of this EP rank only
            path = self._zero_file(dp_rank, mp)
            if not os.path.isfile(path):
                raise self._missing(os.path.basename(path))
            osd = self._file(path)["optimizer_state_dict"]
            for group, mapping in enumerate(osd["param_slice_mappings"]):
                if name in mapping:
                    address = mapping[name]
                    flat = (osd["single_partition_of_fp32_groups"][group] if key == "fp32"
                            else osd["base_optimizer_state"]["state"][group][key])
                    pieces.append(flat.narrow(0, address.start, address.numel))
        numel = _numel(self.params[name].local_shape)
        if sum(p.numel() for p in pieces) != numel:
            raise self._missing(f"part of the optimizer partitions of {name}")
        return torch.cat(pieces) if len(pieces) > 1 else pieces[0]

    def _zero3_local(self, name: str, key: str, tp_rank: int) -> torch.Tensor:
        mp = self.layout.mp_rank(0, tp_rank)
        index = self._flat_index.get(mp)
        if index is None:
            index = self._flat_index[mp] = self._zero3_index(mp)
        if name not in index:
            raise self._missing(f"ZeRO-3 partition of {name}")
        sub_group, offset, partition_numel = index[name]
        parts = []
        for dp_rank in range(self.layout.data_ranks):
            osd = self._file(self._zero_file(dp_rank, mp))["optimizer_state_dict"]
            flat = osd["fp32_flat_groups"][sub_group] if key == "fp32" else osd["optimizer_state_dict"]["state"][sub_group][key]
            parts.append(flat.narrow(0, offset, partition_numel))
        return torch.cat(parts)[: _numel(self.params[name].local_shape)]

    def _zero3_index(self, mp: int) -> dict:
        """name -> (sub-group, offset in it, numel per DP rank): each parameter is split evenly over DP
        (padded), sub-groups hold parameters in ``param_shapes`` order."""
        states_path = os.path.join(self.tag_dir, f"zero_pp_rank_0_mp_rank_{mp:02d}_model_states.pt")
        if not os.path.isfile(states_path):
            raise self._missing(os.path.basename(states_path))
        shapes = [item for group in self._file(states_path)["param_shapes"] for item in group.items()]
        first = self._zero_file(0, mp)
        if not os.path.isfile(first):
            raise self._missing(os.path.basename(first))
        sizes = [t.numel() for t in self._file(first)["optimizer_state_dict"]["fp32_flat_groups"]]
        index, sub_group, offset, dp = {}, 0, 0, self.layout.data_ranks
        for name, shape in shapes:
            partition = -(-_numel(shape) // dp)
            while sub_group < len(sizes) and offset + partition > sizes[sub_group]:
                sub_group, offset = sub_group + 1, 0
            index[name] = (sub_group, offset, partition)
            offset += partition
        return index


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n
