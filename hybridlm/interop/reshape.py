"""Continue a checkpoint at another parallel layout (TP, PP, DP, EP, ZeRO stage, precision).

DeepSpeed loads a checkpoint only at the layout that saved it. Here every rank of the new run
reads, for each parameter it holds, the full tensor (``CheckpointReader``: any saved layout),
cuts its own TP/EP slice with the parameter's sharding tags, and writes it into the engine:
the model weight, and where the saved optimizer state is readable, the fp32 master copy, Adam's
two moments and its step count, into whichever optimizer DeepSpeed built (torch AdamW without
ZeRO, BF16_Optimizer, ZeRO-1/2, ZeRO-3) the way DeepSpeed's own universal-checkpoint loader
does. The iteration, LR schedule and sample count carry over; the random streams are per rank
and cannot, so dropout masks restart. One log line says what was carried and what was reset.

The vocabulary is padded to a multiple of TP: rows beyond the smaller padding are dropped or
zero-filled (padding rows never appear in data).
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch import nn

from ..config import ConfigError, RunConfig
from ..parallel.lora import is_adapter_name
from ..parallel.quantized import load_quantized
from .layout import CheckpointInfo, Layout, ParamInfo, parameter_table, read_info, vocab_parameters
from .lora import open_checkpoint, refuse_dense_resume
from .reader import OPTIMIZER_KEYS, CheckpointReader, OptimizerStateUnavailable

MOMENTS = ("exp_avg", "exp_avg_sq")


def needs_reshape(tag_dir: str, cfg: RunConfig) -> bool:
    """Whether ``--load`` must go through this module rather than DeepSpeed's own loader."""
    if cfg.train.finetune or not cfg.train.load_optim or cfg.model.quant_bits:
        return True  # (QLoRA: the base comes from the checkpoint the loaded one names, through open_checkpoint)
    if not os.path.isfile(os.path.join(tag_dir, "hybridlm_checkpoint.json")):
        return False  # saved before layouts were recorded: DeepSpeed's loader, as before
    info = read_info(tag_dir, "--load")
    return not info.optimizer_state or info.layout != Layout.of_run(cfg) or adds_adapters(info, cfg)


def adds_adapters(info: CheckpointInfo, cfg: RunConfig) -> bool:
    """Whether this run puts LoRA adapters on a checkpoint saved without them (its base): the base's
    weights are loaded, the adapters start from the seed, the optimizer from scratch."""
    return bool(cfg.model.lora_rank) and not info.settings.get("lora_rank")


def check_loadable(tag_dir: str, cfg: RunConfig) -> None:
    """Before any process group exists: the checkpoint holds this model (at any layout), or one sentence says why not."""
    if not os.path.isfile(os.path.join(tag_dir, "hybridlm_checkpoint.json")):
        return  # saved before layouts were recorded; DeepSpeed's loader checks shapes itself
    info = read_info(tag_dir, "--load")
    refuse_dense_resume(info, cfg.model)
    saved = parameter_table(info.model_config(), info.layout.tp, info.layout.ep)
    here = parameter_table(cfg.model, cfg.parallel.tensor_model_parallel_size, cfg.parallel.expert_model_parallel_size)
    check_same_model(saved, here, vocab_parameters(cfg.model), f"--load {tag_dir}", adds_adapters(info, cfg))
    if needs_reshape(tag_dir, cfg) and cfg.train.fp16 and cfg.parallel.zero_stage == 0:
        raise ConfigError(f"--load {tag_dir}: saved at {info.layout.describe()}; continuing it at another layout, or with "
                          "--finetune, in fp16 needs ZeRO (stage 1-3): DeepSpeed's fp16 optimizer without ZeRO cannot be filled from another layout.")


def check_same_model(saved: dict[str, ParamInfo], here: dict[str, ParamInfo], vocab: set[str], where: str,
                     new_adapters: bool = False) -> None:
    """Same parameter names and full shapes (the vocabulary rows may differ by TP padding); with
    ``new_adapters`` this model's LoRA adapters are not in the checkpoint (they start from the seed)."""
    missing = sorted(n for n in set(here) - set(saved) if not (new_adapters and is_adapter_name(n)))
    extra = sorted(set(saved) - set(here))
    if missing or extra:
        name = (missing or extra)[0]
        side = "this model has" if missing else "the checkpoint has"
        raise ConfigError(f"{where} was saved for a different model: {side} parameter {name} and the other does not; "
                          "the model flags must match the checkpoint's config.yaml.")
    for name, info in here.items():
        if name not in saved:
            continue
        a, b = saved[name].full_shape, info.full_shape
        if (a[1:] != b[1:]) if name in vocab else (a != b):
            raise ConfigError(f"{where} was saved for a different model: {name} has shape {a} there and {b} here; "
                              "the model flags must match the checkpoint's config.yaml.")


def fit_rows(tensor: torch.Tensor, rows: int) -> torch.Tensor:
    """Drop or zero-fill trailing rows (vocabulary padding)."""
    if tensor.shape[0] == rows:
        return tensor
    out = tensor.new_zeros((rows, *tensor.shape[1:]))
    keep = min(rows, tensor.shape[0])
    out[:keep] = tensor[:keep]
    return out


def to_local(full: torch.Tensor, param: nn.Parameter, ps) -> torch.Tensor:
    for sharding, group in ((getattr(param, "tp_sharding", None), ps.tp), (getattr(param, "ep_sharding", None), ps.ep)):
        if sharding is not None:
            full = sharding.shard(full, group.rank, group.size)
    return full


class _Source:
    """This rank's slices of the saved tensors, in the new layout's shapes."""

    def __init__(self, reader: CheckpointReader, cfg: RunConfig, ps, tag_dir: str):
        here = parameter_table(cfg.model, ps.tp.size, ps.ep.size)
        check_same_model(reader.params, here, vocab_parameters(cfg.model), f"--load {tag_dir}", adds_adapters(reader.info, cfg))
        self.reader, self.ps, self.here = reader, ps, here
        self.vocab = vocab_parameters(cfg.model)

    def _fit(self, name: str, full: torch.Tensor) -> torch.Tensor:
        return fit_rows(full, self.here[name].full_shape[0]) if name in self.vocab else full

    def weight(self, name: str, param: nn.Parameter) -> torch.Tensor:
        return to_local(self._fit(name, self.reader.weight(name)), param, self.ps).contiguous()

    def optimizer(self, name: str, param: nn.Parameter) -> dict[str, torch.Tensor]:
        state = self.reader.optimizer_state(name)
        return {k: to_local(self._fit(name, v.float()), param, self.ps).contiguous() for k, v in state.items()}


def optimizer_kind(optimizer) -> str:
    """Which of DeepSpeed's optimizer wrappers (or a plain torch optimizer) the engine built."""
    if hasattr(optimizer, "fp32_partitioned_groups_flat"):
        return "zero3"
    if hasattr(optimizer, "bit16_groups") and hasattr(optimizer, "single_partition_of_fp32_groups"):
        return "zero12"
    if hasattr(optimizer, "bf16_groups"):
        return "bf16"
    if isinstance(optimizer, torch.optim.Optimizer):
        return "torch"
    return type(optimizer).__name__


@torch.no_grad()
def load_resharded(engine, ps, cfg: RunConfig, tag_dir: str, rng_restored: bool = False) -> dict:
    """Load ``tag_dir`` (any saved layout) into ``engine`` (this run's layout). Returns the client
    state the trainer resumes from (iteration 0 with ``--finetune`` or a weights-only checkpoint).
    ``rng_restored`` says (for the log) that the caller restores the random streams."""
    reader = open_checkpoint(tag_dir, "--load")
    source = _Source(reader, cfg, ps, tag_dir)
    info: CheckpointInfo = reader.info
    new_adapters = adds_adapters(info, cfg)
    weights_only = cfg.train.finetune or not info.optimizer_state or not cfg.train.load_optim or new_adapters
    optimizer, kind = engine.optimizer, optimizer_kind(engine.optimizer)
    if kind not in ("torch", "zero12", "bf16", "zero3"):
        raise ConfigError(f"--load {tag_dir}: reshaping into DeepSpeed's {kind} optimizer is not supported; "
                          f"continue at the saved layout ({info.layout.describe()}).")
    if getattr(optimizer, "swap_optimizer", False) or getattr(optimizer, "offload_param_nvme", False):
        raise ConfigError(f"--load {tag_dir}: reshaping into a run with NVMe offload is not supported; continue at the "
                          f"saved layout ({info.layout.describe()}) or reshape without NVMe offload first.")
    reset_reason = ("--finetune" if cfg.train.finetune else "the checkpoint has no LoRA adapters" if new_adapters else "the checkpoint holds weights only" if not info.optimizer_state
                    else "--no-load-optim" if weights_only else None)
    step = None
    if reset_reason is None:
        try:
            step = reader.optimizer_step()
        except OptimizerStateUnavailable as e:
            reset_reason = str(e)
    states = _gather(engine.module, source, carry=step is not None)
    for param in [p for p in states if not p.requires_grad]:  # a frozen base (LoRA) is no optimizer's: copied as it is
        param.copy_(states.pop(param)["weight"].to(param.device, param.dtype))
    quantized = load_quantized(engine.module, reader.weight)  # a 4-bit base (QLoRA): quantized from the dense weights, one at a time
    if quantized and (not dist.is_initialized() or dist.get_rank() == 0):
        print(f"--load {tag_dir}: {quantized} weights of this rank's layers quantized to 4 bits from "
              f"{getattr(reader, 'base', reader).tag_dir}", flush=True)
    {"torch": _into_torch, "zero12": _into_hp_mapped, "bf16": _into_hp_mapped, "zero3": _into_zero3}[kind](optimizer, states, step)
    load_buffers(engine.module, reader)
    # --no-load-optim (Megatron's checkpointing.py): the weights and the iteration, but neither the
    # optimizer nor the LR schedule, which starts again from its first step
    client = {} if cfg.train.finetune or not info.optimizer_state else reader.client_state()
    if client:
        engine.global_steps = client.get("global_steps", client.get("iteration", 0))
        engine.global_samples = client.get("global_samples", engine.global_steps * engine.train_batch_size())
        engine.skipped_steps = client.get("skipped_steps", 0)
        if not weights_only and engine.lr_scheduler is not None and client.get("lr_scheduler") is not None:
            engine.lr_scheduler.load_state_dict(client["lr_scheduler"])
    _log(tag_dir, info, Layout.of_run(cfg), step, reset_reason, client, cfg.train.global_batch_size,
         schedule_kept=not weights_only, rng_restored=rng_restored)
    return {"iteration": client.get("iteration", 0), "consumed_samples": client.get("consumed_samples", 0),
            "wandb_run_id": client.get("wandb_run_id")}


@torch.no_grad()
def load_buffers(module: nn.Module, reader: CheckpointReader) -> None:
    """Copy the saved persistent buffers (replicated, so the same at every layout) into ``module``;
    one the checkpoint lacks keeps its initial value (an expert bias starts at zero)."""
    params = {name for name, _ in module.named_parameters()}
    buffers = dict(module.named_buffers())
    for name in module.state_dict():
        if name not in params and buffers.get(name) is not None:
            saved = reader.buffer(name)
            if saved is not None:
                buffers[name].copy_(saved.to(buffers[name].device, buffers[name].dtype))


def _gather(module: nn.Module, source: _Source, *, carry: bool) -> dict:
    """param -> {"weight": local value, and with ``carry`` fp32 / exp_avg / exp_avg_sq} (trainable
    parameters only); an adapter the checkpoint lacks keeps its initial value."""
    states = {}
    for name, param in module.named_parameters():
        if name not in source.reader.params:
            continue
        entry = {"weight": source.weight(name, param)}
        if carry and param.requires_grad:
            entry.update(source.optimizer(name, param))
        states[param] = entry
    return states


def _into_torch(optimizer, states: dict, step) -> None:
    """fp32 without ZeRO: the module parameters are the master weights; torch AdamW's own state."""
    for param, entry in states.items():
        param.copy_((entry["fp32"] if step is not None else entry["weight"]).to(param.device, param.dtype))
        if step is not None:
            optimizer.state[param] = {"step": _step_tensor(step, optimizer, param),
                                      **{k: entry[k].to(param.device) for k in MOMENTS}}


def _step_tensor(step: int, optimizer, param):
    """Adam's step in the form the optimizer keeps it: torch's a float tensor (on the device when
    fused or capturable), DeepSpeed's CPU Adam a plain int."""
    if not isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        return step
    group = next((g for g in optimizer.param_groups if any(p is param for p in g["params"])), {})
    on_device = group.get("fused") or group.get("capturable")
    return torch.tensor(float(step), dtype=torch.float32, device=param.device if on_device else "cpu")


def _into_hp_mapped(optimizer, states: dict, step) -> None:
    """ZeRO-1/2 and BF16_Optimizer: each low-precision parameter maps a fragment of its flat fp32
    partition (``_hp_mapping``); fill the fragments, then let DeepSpeed lay the moments out flat."""
    from deepspeed.utils.tensor_fragment import map_to_flat_opt_states

    lp_groups = optimizer.bit16_groups if hasattr(optimizer, "bit16_groups") else optimizer.bf16_groups
    for group_index, lp_group in enumerate(lp_groups):
        for lp in lp_group:
            entry = states.get(lp)
            if entry is None:
                continue  # an adapter the checkpoint lacks: its initial value, already DeepSpeed's master copy
            master = entry["fp32"] if step is not None else entry["weight"].float()
            lp.copy_(master.to(lp.device, lp.dtype))  # what DeepSpeed's step leaves in the low-precision copy
            mapping = lp._hp_mapping
            if mapping is None:
                continue  # no fragment of this parameter in this rank's partition
            address = mapping.lp_fragment_address
            mapping.hp_fragment.copy_(master.flatten().narrow(0, address.start, address.numel))
            if step is not None:
                mapping.optim_fragment = {k: entry[k].flatten().narrow(0, address.start, address.numel)
                                          .to(mapping.hp_fragment.device).clone() for k in MOMENTS}
        if step is not None:
            flat = optimizer.optimizer.param_groups[group_index]["params"][0]
            optimizer.optimizer.state[flat]["step"] = _step_tensor(step, optimizer.optimizer, flat)
            map_to_flat_opt_states(flat, lp_group, optimizer.optimizer.state, list(MOMENTS))


def _into_zero3(optimizer, states: dict, step) -> None:
    """ZeRO-3: each parameter is split evenly over its partition group; the flat fp32 sub-groups
    (and the moments, laid out the same way) are rebuilt from this rank's slices, as DeepSpeed's
    universal loader does, then copied into the low-precision partitions."""
    optimizer.checkpoint_event_prologue()
    keys = OPTIMIZER_KEYS if step is not None else ("fp32",)
    for key in keys:
        for sub_group, params in enumerate(optimizer.fp16_groups):
            flat = optimizer.fp32_partitioned_groups_flat[sub_group]
            values = torch.zeros_like(flat)
            offset = 0
            for param in params:
                entry = states[param]
                full = (entry["weight"].float() if key == "fp32" and step is None else entry[key]).flatten()
                group = optimizer._get_param_partition_group(param)
                rank, size = dist.get_rank(group=group), dist.get_world_size(group=group)
                numel = param.ds_tensor.ds_numel
                padded = torch.nn.functional.pad(full, (0, numel * size - full.numel()))
                values.narrow(0, offset, numel).copy_(padded.narrow(0, rank * numel, numel))
                offset += numel
            if key == "fp32":
                flat.data.copy_(values)
                if step is not None:
                    optimizer.optimizer.state[flat]["step"] = _step_tensor(step, optimizer.optimizer, flat)
            else:
                optimizer.optimizer.state[flat][key] = values
    for sub_group, flat in enumerate(optimizer.fp32_partitioned_groups_flat):
        low = optimizer.fp16_partitioned_groups_flat[sub_group]
        low.data.copy_(flat.data)
        for partition, value in zip(optimizer.fp16_partitioned_groups[sub_group],
                                    optimizer.unflatten(low, optimizer.fp16_partitioned_groups[sub_group])):
            partition.data = value.data
    optimizer.checkpoint_event_epilogue()


def _log(tag_dir: str, info: CheckpointInfo, here: Layout, step, reset_reason, client, global_batch: int,
         schedule_kept: bool = True, rng_restored: bool = False) -> None:
    if dist.is_initialized() and dist.get_rank() != 0:
        return
    tag = os.path.basename(os.path.normpath(tag_dir))
    carried = ["model weights"] + (["random streams"] if rng_restored else [])
    reset = [] if rng_restored else ["random streams (dropout masks restart)"]
    if step is not None:
        carried.append(f"optimizer state (fp32 master weights, Adam moments, step {step})")
    else:
        reset.insert(0, f"optimizer state ({reset_reason})")
    if client and schedule_kept:
        carried.append(f"LR schedule and iteration {client.get('iteration', 0)}")
    elif client:
        carried.append(f"iteration {client.get('iteration', 0)}")
        reset.insert(min(1, len(reset)), "LR schedule (starts again from its first step)")
    else:
        reset.insert(min(1, len(reset)), "LR schedule and iteration (start at 0)")
    note = ""
    consumed, iteration = client.get("consumed_samples"), client.get("iteration", 0)
    if consumed is not None and consumed != iteration * global_batch:
        note = (f" Note: {consumed} samples were consumed in {iteration} steps, but --global-batch-size {global_batch} "
                f"resumes the data and the LR schedule at sample {iteration * global_batch}.")
    print(f"--load {os.path.dirname(os.path.abspath(tag_dir))}: {tag} saved at {info.layout.describe()}, "
          f"loaded at {here.describe()}; carried: {', '.join(carried)}; reset: {', '.join(reset)}.{note}", flush=True)
