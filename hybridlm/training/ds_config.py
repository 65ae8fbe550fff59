"""Read the DeepSpeed JSON and reconcile it with the flags, before any process group exists.

The shipped configs say "auto" for batch sizes, clipping and precision: those come from
the flags. A concrete value in the JSON is adopted when the matching flag was not typed,
and is an error when it was typed with another value: one source of truth, and no
silent winner.
"""
from __future__ import annotations

import copy
import json
import os
import tempfile

from ..config import ConfigError, RunConfig

# JSON path -> (flag, config section, field)
_LINKED = {
    ("train_micro_batch_size_per_gpu",): ("--micro-batch-size", "train", "micro_batch_size"),
    ("train_batch_size",): ("--global-batch-size", "train", "global_batch_size"),
    ("gradient_clipping",): ("--clip-grad", "train", "clip_grad"),
    ("bf16", "enabled"): ("--bf16", "train", "bf16"),
    ("fp16", "enabled"): ("--fp16", "train", "fp16"),
    ("zero_optimization", "overlap_comm"): ("--overlap-grad-reduce", "parallel", "overlap_grad_reduce"),
}


# the repository (or source tree) the package runs from, where ds_configs/ lives
_SOURCE_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def read_ds_config(path: str) -> dict:
    """The JSON at ``path``; a relative path not found from the working directory is also looked
    up in the source tree, so a Megatron-LM script (which names no JSON) gets the default
    ds_configs/zero1.json from wherever it is launched."""
    if not os.path.isfile(path) and not os.path.isabs(path) and os.path.isfile(os.path.join(_SOURCE_ROOT, path)):
        path = os.path.join(_SOURCE_ROOT, path)
    if not os.path.isfile(path):
        raise ConfigError(f"--deepspeed_config {path}: no such file.")
    try:
        with open(path) as f:
            ds = json.load(f)
    except json.JSONDecodeError as e:
        raise ConfigError(f"--deepspeed_config {path}: invalid JSON at line {e.lineno}, column {e.colno}: {e.msg}.") from None
    if not isinstance(ds, dict):
        raise ConfigError(f"--deepspeed_config {path}: the top level must be a JSON object.")
    return ds


def _get(ds: dict, keys: tuple):
    for k in keys:
        if not isinstance(ds, dict) or k not in ds:
            return None
        ds = ds[k]
    return ds


def _set(ds: dict, keys: tuple, value) -> None:
    for k in keys[:-1]:
        ds = ds.setdefault(k, {})
    ds[keys[-1]] = value


def adopt_ds_config(ds: dict, cfg: RunConfig, path: str) -> None:
    """Take concrete JSON values into ``cfg`` (or refuse a conflict); read the ZeRO stage."""
    for keys, (flag, section, name) in _LINKED.items():
        value = _get(ds, keys)
        if value is None or value == "auto":
            continue
        target = getattr(cfg, section)
        if name in cfg.explicit and getattr(target, name) != value:
            raise ConfigError(f"{flag} {getattr(target, name)} conflicts with \"{'.'.join(keys)}\": {value} in {path}; "
                              "set one of them (or \"auto\" in the JSON).")
        setattr(target, name, value)
    stage = _get(ds, ("zero_optimization", "stage"))
    if stage not in (None, 0, 1, 2, 3):
        raise ConfigError(f"{path}: zero_optimization.stage must be 0, 1, 2 or 3, got {stage!r}.")
    cfg.parallel.zero_stage = stage or 0
    if "scheduler" in ds:
        raise ConfigError(f"{path} has a \"scheduler\" section; the schedule comes from --lr, --min-lr, --lr-warmup-iters "
                          "and --lr-decay-style, so remove it.")


def ds_config_of(cfg: RunConfig) -> dict:
    """The run's JSON (``--deepspeed_config``), its concrete values taken into ``cfg`` (``adopt_ds_config``): the first
    check of every run, in the trainer and before torch is imported (training/entry.py)."""
    ds = read_ds_config(cfg.train.deepspeed_config)
    adopt_ds_config(ds, cfg, cfg.train.deepspeed_config)
    return ds


def model_dtype(cfg: RunConfig) -> "torch.dtype":
    """The dtype DeepSpeed gives the parameters (and accumulates their gradients in, by default). torch is imported
    here, not with the module: the launched scripts read the JSON before they import torch (training/entry.py)."""
    import torch
    return torch.bfloat16 if cfg.train.bf16 else torch.float16 if cfg.train.fp16 else torch.float32


def check_gradient_accumulation_fusion(ds: dict, cfg: RunConfig, offloaded: list[str]) -> None:
    """What the JSON must leave alone for TE to accumulate into the gradients DeepSpeed reads."""
    from deepspeed.runtime.config import DtypeEnum
    path = cfg.train.deepspeed_config
    if offloaded:
        raise ConfigError(f"--gradient-accumulation-fusion cannot be combined with offload_{offloaded[0]} (in {path}): "
                          "offloaded gradients have not been checked with it.")
    accum = _get(ds, ("data_types", "grad_accum_dtype"))
    if accum is not None and DtypeEnum(accum).value != model_dtype(cfg):
        raise ConfigError(f"--gradient-accumulation-fusion cannot be combined with \"data_types.grad_accum_dtype\": {accum!r} "
                          f"in {path}: DeepSpeed then moves every micro-batch's gradients into an accumulator of its own.")


def _set_gradient_precision(ds: dict, accumulate: str, reduce: str, path: str) -> None:
    """--accumulate-allreduce-grads-in-fp32 (and --grad-reduce-in-bf16): DeepSpeed's accumulation and communication
    dtypes, unless the JSON says otherwise, which is refused."""
    from deepspeed.runtime.config import DtypeEnum
    for keys, value in ((("data_types", "grad_accum_dtype"), accumulate), (("communication_data_type",), reduce)):
        given = _get(ds, keys)
        try:
            differs = given not in (None, "auto") and DtypeEnum(given) != DtypeEnum(value)
        except ValueError:
            raise ConfigError(f"\"{'.'.join(keys)}\": {given!r} in {path} is not a dtype DeepSpeed knows (fp32, bf16, fp16).") from None
        if differs:
            raise ConfigError(f"--accumulate-allreduce-grads-in-fp32 asks for \"{'.'.join(keys)}\": \"{value}\" but {path} "
                              f"says {given!r}; set one of them.")
        _set(ds, keys, value)


def offload_device(ds: dict, what: str) -> str | None:
    device = _get(ds, ("zero_optimization", f"offload_{what}", "device"))
    return None if device in (None, "none") else device


def finalize_ds_config(ds: dict, cfg: RunConfig) -> dict:
    """The dict handed to ``deepspeed.initialize``: every "auto" filled, checked against the layout."""
    ds = copy.deepcopy(ds)
    t, p = cfg.train, cfg.parallel
    gas = cfg.gradient_accumulation_steps
    declared_gas = ds.get("gradient_accumulation_steps", "auto")
    if declared_gas != "auto" and declared_gas != gas:
        raise ConfigError(f"gradient_accumulation_steps {declared_gas} in {t.deepspeed_config} does not match "
                          f"--global-batch-size {t.global_batch_size} / (--micro-batch-size {t.micro_batch_size} x DP {p.data_parallel_size}) = {gas}.")
    ds["train_micro_batch_size_per_gpu"] = t.micro_batch_size
    # DeepSpeed counts CP ranks as data-parallel replicas (hybridlm.parallel.state), each with
    # its own micro-batch of 1/CP of every sample: its batch is the global batch's slices.
    ds["train_batch_size"] = t.global_batch_size * p.context_parallel_size
    ds["gradient_accumulation_steps"] = gas
    ds["gradient_clipping"] = t.clip_grad
    _set(ds, ("bf16", "enabled"), t.bf16)
    _set(ds, ("fp16", "enabled"), t.fp16)
    if p.zero_stage >= 1:
        _set(ds, ("zero_optimization", "overlap_comm"), p.overlap_grad_reduce)
    elif _get(ds, ("zero_optimization", "overlap_comm")) == "auto":
        del ds["zero_optimization"]["overlap_comm"]
    ds.setdefault("steps_per_print", 10**9)  # our own log line replaces DeepSpeed's
    ds.setdefault("wall_clock_breakdown", False)
    # DeepSpeed's throughput timer synchronises the device at every micro-batch's forward and
    # step by default, so the host never runs ahead of the GPU (on one H200 this left the FP8
    # reference idle at every micro-batch boundary). Our log line measures throughput without
    # it; a JSON that configures the timer keeps its own setting.
    ds.setdefault("timers", {}).setdefault("throughput", {"enabled": False, "synchronized": False})
    if p.sequence_parallel:
        # Activations between stages differ across TP ranks under SP: never split-and-regather them.
        ds["pipeline"] = {**ds.get("pipeline", {}), "pipe_partitioned": False, "grad_partitioned": False}
    if t.bf16 and t.accumulate_allreduce_grads_in_fp32:
        _set_gradient_precision(ds, "fp32", "bf16" if t.grad_reduce_in_bf16 else "fp32", t.deepspeed_config)
    for what in ("optimizer", "param"):
        key = ("zero_optimization", f"offload_{what}", "nvme_path")
        if _get(ds, key) == "auto":
            path = t.nvme_path or os.path.join(tempfile.gettempdir(), "hybridlm_nvme")
            os.makedirs(path, exist_ok=True)
            _set(ds, key, path)
    return ds
