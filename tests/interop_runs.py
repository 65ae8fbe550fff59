"""Training runs the interop tests share, and what they need from inside the ranks.

``train`` runs in each rank: it builds the run from flags as ``scripts/pretrain.py`` does
(``--load`` included, so it also continues checkpoints), trains a few steps, optionally saves,
and returns the losses and the *live* model's full tensors, gathered from the engine (weights,
and optionally the fp32 master copies, Adam moments and step), independently of any file.
Tests compare files, exports and reshapes against these.

``saved_run`` trains a checkpoint once per session per (world, flags) and hands out its folder.
"""
from __future__ import annotations

import os

import torch

from harness import run_ranks
from oracle import TINY, ds_config

# TINY with a slightly longer warm-up-free schedule: two steps to save, two more to continue.
BASE = TINY + ["--log-interval", "1", "--lr-decay-iters", "8"]
TP2PP2 = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]
UNTIED = ["--untie-embeddings-and-output-weights"]
GPT2 = ["--normalization", "LayerNorm", "--position-embedding-type", "learned_absolute", "--no-swiglu", "--add-bias-linear",
        "--num-query-groups", "4"]
MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-z-loss-coeff", "1e-3"]
EP2 = ["--expert-model-parallel-size", "2"]
# What Qwen2-MoE adds to Mixtral: dense layers between MoE ones, pre-softmax top-k, a gated shared expert, QKV biases.
QWEN2_MOE = MOE + ["--moe-layer-freq", "2", "--moe-router-pre-softmax", "--moe-shared-expert-intermediate-size", "64",
                   "--moe-shared-expert-gate", "--add-qkv-bias"]

_saved: dict = {}


def _live_state(run, with_optimizer: bool) -> dict:
    """Full tensors of the running model (all ranks call; every rank gets them)."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    from hybridlm.interop.reshape import optimizer_kind
    from hybridlm.model.weights import gather_full_state_dict

    module, ps, optimizer = run.engine.module, run.ps, run.engine.optimizer
    kind = optimizer_kind(optimizer)
    named = list(module.named_parameters())
    if with_optimizer and kind == "zero12":
        # DeepSpeed 0.19.8 links the parameters to their Adam state after stepping the *first*
        # parameter group, when the other groups have no state yet; link again now that all do.
        optimizer._hp_optimizer_states_linked = False
        optimizer._lazy_init_hp_params_optimizer_state()

    def local(key: str) -> dict:
        values = {}
        for name, p in named:
            if key == "weight":
                value = safe_get_full_fp32_param(p) if hasattr(p, "ds_id") else p.detach()
            elif kind == "torch":
                value = p.detach() if key == "fp32" else optimizer.state[p][key]
            else:
                value = safe_get_full_fp32_param(p) if key == "fp32" else safe_get_full_optimizer_state(p, key)
            if ps.pp.rank == 0 or not name.startswith("tied_modules."):  # the first stage's copy of tied weights
                values[name] = value
        return values

    keys = ("weight", "fp32", "exp_avg", "exp_avg_sq") if with_optimizer else ("weight",)
    return {key: gather_full_state_dict(local(key), module, ps.tp, ps.grad_reduction, ps.ep) for key in keys}


def train(flags: list[str], steps: int, save: bool = False, with_optimizer: bool = False) -> dict:
    """In each rank: (continue and) train ``steps`` steps; save if asked; losses + live full tensors."""
    import logging

    from deepspeed.utils import logger

    from hybridlm.config import parse_args
    from hybridlm.training.checkpoint import write_run_files
    from hybridlm.training.trainer import build_run, data_iterator, prepare_config, save_checkpoint, train_step

    logger.setLevel(logging.WARNING)
    cfg, ds = prepare_config(parse_args(flags))
    run = build_run(cfg, ds)
    start = run.iteration
    batches = data_iterator(run)
    losses = [train_step(run, batches).item() for _ in range(steps)]
    if save:
        if torch.distributed.get_rank() == 0:
            write_run_files(cfg.train.save, cfg, ds)
        save_checkpoint(run)
    return {"start": start, "losses": losses, **_live_state(run, with_optimizer)}


def saved_run(root, world: int, flags: list[str], zero: str, steps: int = 2, with_optimizer: bool = True) -> tuple[str, dict]:
    """(run directory, rank 0's result) of ``flags`` trained ``steps`` steps and saved; once per session."""
    key = (world, tuple(flags), zero, steps)
    if key not in _saved:
        directory = os.path.join(str(root), f"run{len(_saved)}")
        result = run_ranks(world, train, BASE + flags + ds_config(zero) + ["--train-iters", str(steps), "--save", directory],
                           steps, True, with_optimizer)[0]
        _saved[key] = (directory, result)
    return _saved[key]


def hybridlm_logits(weights: dict, settings_dir: str, tokens: torch.Tensor) -> torch.Tensor:
    """Logits [batch, seq, vocab] of the single-process model with ``weights`` (full tensors), the
    model settings read from the checkpoint folder ``settings_dir``."""
    from hybridlm.interop.layout import read_info, resolve_tag_dir
    from hybridlm.model.specs import build_model
    from hybridlm.model.weights import load_full_state_dict
    from hybridlm.parallel.plan import LayerFactory
    from hybridlm.parallel.state import SINGLE

    cfg = read_info(resolve_tag_dir(settings_dir)).model_config(tp=1)
    model = build_model(cfg, LayerFactory()).eval()
    load_full_state_dict(model, {k: v.float() for k, v in weights.items()}, SINGLE)
    with torch.no_grad():
        return model(tokens).permute(1, 0, 2)[..., : cfg.vocab_size]
