"""DPO's reference log-probabilities, computed once before training and kept beside the data.

The reference model's log-probability of each chosen and rejected reply is all DPO needs from
it, so instead of holding a second model through training, the run's own engine, at the run's
layout and precision, loads the reference weights (``--ref-load``, default ``--load``), runs the
forward pass over every pair once (the DPO loss in its recording mode collects the sums on the
last pipeline stage) and writes them to ``<data prefix>.reference-<key>.npy``; training then loads
the policy and reads the sums with each micro-batch. The key hashes what the numbers depend on:
the reference checkpoint (its folder and every file's size and modification time), the data (its
index files and sizes), the sequence length, the model settings and the precision, so a later run
with the same inputs reuses the file and a changed input computes it again.

With LoRA (``--lora-rank``) the reference is the policy's own frozen base: after ``--load`` the
same engine runs the pairs with its adapters switched off (``adapters_disabled``), so no other
weights are loaded, then or ever, and a resumed run (whose base has not moved) gets the same numbers.
"""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import itertools
import json
import math
import os
import time

import numpy as np
import torch
import torch.distributed as dist

from ..config import ConfigError
from ..data.chat_dataset import DPOPairs
from ..data.chat_preprocess import mask_prefix
from ..data.samples import micro_batches
from ..interop.layout import resolve_tag_dir
from ..parallel.lora import adapters_disabled
from .checkpoint import tag_for
from .distributed import device
from .step import run_step

REFERENCE_FILE = "dpo_reference.json"  # in each DPO checkpoint: which checkpoint its reference log-probs came from


def _files_key(paths, root: str = "") -> list:
    return [(os.path.relpath(p, root) if root else os.path.basename(p), os.path.getsize(p), os.stat(p).st_mtime_ns)
            for p in sorted(paths)]


def reference_key(cfg, tag_dir: str, prefix: str) -> str:
    tag_files = [os.path.join(d, f) for d, _, files in os.walk(tag_dir) for f in files]
    data_files = [prefix + ".idx", prefix + ".bin", mask_prefix(prefix) + ".idx", mask_prefix(prefix) + ".bin"]
    model = {k: v for k, v in dataclasses.asdict(cfg.model).items() if k not in ("attention_backend", "fused_ops", "torch_compile",
                                                                                   "torch_compile_backend")}
    description = {"checkpoint": os.path.abspath(tag_dir), "files": _files_key(tag_files, tag_dir), "data": _files_key(data_files),
                   "seq_length": cfg.model.seq_length, "model": model, "bf16": cfg.train.bf16, "fp16": cfg.train.fp16}
    return hashlib.sha256(json.dumps(description, sort_keys=True, default=str).encode()).hexdigest()[:20]


def reference_checkpoint(cfg) -> tuple[str, str]:
    """(the reference's checkpoint folder, how it was named): --ref-load; else the reference a resumed
    DPO run started with (recorded in its checkpoints: its --load is now the policy's own); else --load."""
    if cfg.posttrain.ref_load:
        return resolve_tag_dir(cfg.posttrain.ref_load, "--ref-load"), f"--ref-load {cfg.posttrain.ref_load}"
    step = cfg.train.ckpt_step
    tag_dir = os.path.join(cfg.train.load, tag_for(step)) if step is not None else resolve_tag_dir(cfg.train.load, "--load")
    recorded = os.path.join(tag_dir, REFERENCE_FILE)
    if os.path.isfile(recorded):
        with open(recorded) as f:
            previous = json.load(f)["reference"]
        return previous, f"the reference {previous} this run started with"
    return tag_dir, f"--load {cfg.train.load}"


def reference_logps(run, task) -> np.ndarray:
    """[pairs, 2] reference log-prob sums (chosen, rejected), read from the cache or computed (collective)."""
    cfg = run.cfg
    tag_dir, source = reference_checkpoint(cfg)
    task.reference_tag = os.path.abspath(tag_dir)
    prefix = task.chat_data().prefix
    path = f"{prefix}.reference-{reference_key(cfg, tag_dir, prefix)}.npy"
    rank0 = dist.get_rank() == 0
    if os.path.isfile(path):
        if rank0:
            print(f"dpo reference: log-probabilities of {source} read from {path}", flush=True)
        return np.load(path)
    lora = bool(cfg.model.lora_rank)
    if not lora:
        load_weights(run, tag_dir)
    start = time.perf_counter()
    with adapters_disabled(run.engine.module) if lora else contextlib.nullcontext():
        values = _forward_all(run, task)
    task.reference_seconds = time.perf_counter() - start  # the forward passes alone (benchmarks report it)
    if rank0:
        tmp = f"{path}.tmp{os.getpid()}.npy"
        np.save(tmp, values)
        os.replace(tmp, path)
        print(f"dpo reference: log-probabilities of {source} over {len(values):,} pairs computed in "
              f"{task.reference_seconds:.1f} s at this run's layout; saved to {path}", flush=True)
    dist.barrier()
    return values


def load_weights(run, tag_dir: str) -> None:
    """The reference weights into the engine (its optimizer state is not touched; --load follows)."""
    from ..interop.reshape import load_resharded
    weights_only = dataclasses.replace(run.cfg, train=dataclasses.replace(run.cfg.train, finetune=True))
    if not os.path.isfile(os.path.join(tag_dir, "hybridlm_checkpoint.json")):
        raise ConfigError(f"DPO reference {tag_dir}: not a checkpoint hybridlm can read at any layout (no hybridlm_checkpoint.json); "
                          "name the reference model with --ref-load.")
    load_resharded(run.engine, run.ps, weights_only, tag_dir)


@torch.no_grad()
def _forward_all(run, task) -> np.ndarray:
    """Every pair once, in order, global batch by global batch (the last one wraps around)."""
    cfg, engine, loss = run.cfg, run.engine, task.dpo_loss
    t = cfg.train
    pairs = DPOPairs(task.chat_data(), cfg.model.seq_length, t.seed, task.pad_id(), shuffle=False)
    batches = micro_batches(pairs, micro_batch_size=t.micro_batch_size, global_batch_size=t.global_batch_size,
                            dp_rank=run.ps.dp.rank, dp_size=run.ps.dp.size, device=device(),
                            cp_rank=run.ps.cp.rank, cp_size=run.ps.cp.size)
    loss.recording, loss.records = True, []
    try:
        for _ in range(math.ceil(pairs.num_pairs / t.global_batch_size)):
            run_step(run, itertools.islice(batches, cfg.gradient_accumulation_steps), train=False)
    finally:
        loss.recording = False
        engine.train()
    values = torch.zeros(pairs.num_pairs, 2, dtype=torch.float64, device=engine.device)
    seen = torch.zeros(pairs.num_pairs, dtype=torch.float64, device=engine.device)
    for ids, chosen, rejected in loss.records:
        values[ids, 0], values[ids, 1], seen[ids] = chosen.to(values.device), rejected.to(values.device), 1.0
    loss.records = []
    # Every TP and CP rank of the last stage holds the same numbers: sum over DP, then bring them to every stage.
    for group in (run.ps.dp, run.ps.pp):
        if group.size > 1:
            dist.all_reduce(values, group=group.group)
            dist.all_reduce(seen, group=group.group)
    return (values / seen.clamp_min(1).unsqueeze(1)).cpu().numpy()
