"""Checkpoints a crash cannot corrupt, and resumes that continue bit for bit.

A checkpoint is DeepSpeed's own tag folder (``global_step<N>``: model, ZeRO partitions,
optimizer, LR schedule) plus what DeepSpeed does not keep: the iteration and consumed
samples (client state) and every random stream of every rank (python, numpy, torch, the
accelerator, the TP tracker), one small file per rank. Each tag also records the layout and
settings that saved it and every EP rank's experts, so that it can be read offline and continued
at another layout (``hybridlm.interop``).

It becomes the one ``--load`` picks only when complete: DeepSpeed's own ``latest`` file is
written by rank 0 without waiting for the other ranks, so we pass ``save_latest=False``,
wait for every rank, and then write ``latest`` under a temporary name and rename it (an
atomic replace). A job killed mid-save leaves ``latest`` pointing at the previous complete
checkpoint (the half-written folder is overwritten by the next save); a save that fails (a full disk)
removes its folder and stops the run with one sentence (``checkpoint_io``).
"""
from __future__ import annotations

import json
import os
import pickle
import random
import re
import shutil
import time
import zipfile

import numpy as np
import torch
import torch.distributed as dist
from deepspeed.accelerator import get_accelerator
from deepspeed.runtime.activation_checkpointing import checkpointing as ds_checkpointing

from ..config import ConfigError
from ..interop.experts import load_expert_weights, save_expert_weights
from ..interop.layout import Layout, atomic_torch_save, atomic_write_text, read_info, write_info
from ..interop.lora import quantized_base_of
from ..interop.reshape import check_loadable, load_resharded, needs_reshape
from .checkpoint_io import (CheckpointSaveFailed, WriteRecorder, agreed_failure, folder_bytes,
                            human_bytes)

LATEST = "latest"
_TAG = re.compile(r"^global_step(\d+)$")


def tag_for(iteration: int) -> str:
    return f"global_step{iteration}"


def latest_tag(directory: str) -> str | None:
    path = os.path.join(directory, LATEST)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return f.read().strip() or None


def _rng_file(directory: str, tag: str, rank: int) -> str:
    return os.path.join(directory, tag, f"rng_state_rank{rank}.pt")


def rng_state() -> dict:
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
            "accelerator": get_accelerator().get_rng_state(),
            "tracker": {k: v.clone() for k, v in ds_checkpointing.get_cuda_rng_tracker().get_states().items()}}


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    get_accelerator().set_rng_state(state["accelerator"])
    ds_checkpointing.get_cuda_rng_tracker().set_states(state["tracker"])


def refuse_overwrite(save_dir: str | None, load_dir: str | None) -> None:
    """An existing run directory is resumed (``--load`` it) or refused, never overwritten."""
    if save_dir and latest_tag(save_dir) and os.path.abspath(save_dir) != os.path.abspath(load_dir or ""):
        raise ConfigError(f"--save {save_dir} already holds checkpoints (latest: {latest_tag(save_dir)}); "
                          f"resume with --load {save_dir}, or save to a new directory.")


def tag_to_load(load_dir: str, step: int | None) -> str | None:
    """The tag ``--load`` (with ``--ckpt-step``) picks; None while the directory holds no checkpoint."""
    return tag_for(step) if step is not None else latest_tag(load_dir)


def refuse_tag_folder(load_dir: str) -> None:
    """``--load runs/x/global_step20`` names one checkpoint's folder, which holds no ``latest``:
    loading it would find nothing and start from scratch, never what was meant."""
    name = os.path.basename(os.path.normpath(load_dir))
    match = _TAG.match(name)
    if match and os.path.isdir(load_dir) and latest_tag(load_dir) is None:
        parent = os.path.dirname(os.path.normpath(load_dir)) or "."
        raise ConfigError(f"--load {load_dir} is one checkpoint's folder, not the directory that holds them: "
                          f"use --load {parent} --ckpt-step {match.group(1)}.")


def no_checkpoint_reason(load_dir: str) -> str:
    """Why ``--load`` finds nothing to load (for the start-from-scratch warning and the refusals)."""
    if not os.path.isdir(load_dir):
        return f"--load {load_dir}: no such directory"
    return f"--load {load_dir} holds no checkpoint (no '{LATEST}' file)"


def require_checkpoint(load_dir: str, step: int | None) -> None:
    """Before any process group: ``--load`` names a checkpoint (fine-tuning has no use for a random start)."""
    refuse_tag_folder(load_dir)
    if tag_to_load(load_dir, step) is None:
        raise ConfigError(f"{no_checkpoint_reason(load_dir)}: fine-tuning starts from the weights it loads; give a "
                          "folder written by convert_from_hf.py or by a training run's --save.")


def check_load(load_dir: str | None, step: int | None, cfg) -> None:
    """Before any process group: the checkpoint ``--load`` would pick exists and holds this model
    (none at all is Megatron's start from scratch, which a requeued job's first run relies on)."""
    if not load_dir:
        return
    refuse_tag_folder(load_dir)
    tag = tag_to_load(load_dir, step)
    if tag is None:
        return
    if not os.path.isdir(os.path.join(load_dir, tag)):
        raise ConfigError(f"--load {load_dir}: checkpoint {tag} does not exist.")
    refuse_damaged(load_dir, tag)
    check_loadable(os.path.join(load_dir, tag), cfg)


def refuse_damaged(load_dir: str, tag: str) -> None:
    """A file of the tag that is not a whole torch archive (a save that was interrupted or ran out of space; the
    check reads only each file's end) is one sentence before any process group, not a traceback from its loader."""
    tag_dir = os.path.join(load_dir, tag)
    for root, _, files in os.walk(tag_dir):
        for name in sorted(files):
            if name.endswith(".pt") and not zipfile.is_zipfile(os.path.join(root, name)):
                raise ConfigError(damaged(load_dir, tag, f"{os.path.relpath(os.path.join(root, name), tag_dir)} is truncated "
                                                         "or not a checkpoint file"))


def damaged(load_dir: str, tag: str, what: str) -> str:
    """The sentence for a checkpoint that cannot be read, naming the one ``latest`` offers instead."""
    latest = latest_tag(load_dir)
    other = f"load 'latest' ({latest}) or another step with --ckpt-step" if latest and latest != tag else \
        "load another step with --ckpt-step"
    return f"--load {load_dir}: checkpoint {tag} is damaged: {what} (a save that did not complete?); {other}."


def task_state_file(tag_dir: str, rank: int) -> str:
    """Where a task keeps what only this rank holds (GRPO: its rollout stream and unfinished rollout batch)."""
    return os.path.join(tag_dir, f"task_state_rank{rank}.pt")


def quantized_base(cfg) -> str | None:
    """Before any process group, for a QLoRA run (``--quant-bits``): the checkpoint folder its 4-bit base
    is quantized from, which its checkpoints will name (None: the base is the seed's initialisation)."""
    t = cfg.train
    if not cfg.model.quant_bits or not t.load:
        return None
    tag = tag_to_load(t.load, t.ckpt_step)
    if tag is None:
        if t.save:
            raise ConfigError(f"{no_checkpoint_reason(t.load)}: with --quant-bits and --save, --load must name the base "
                              "checkpoint the 4-bit base is quantized from (a QLoRA checkpoint names it instead of storing it).")
        return None
    return quantized_base_of(os.path.join(t.load, tag), cfg.model)


def save(engine, directory: str, *, iteration: int, client_state: dict, keep_last: int | None, cfg=None, ps=None,
         text_files: dict | None = None, rank_state: dict | None = None) -> None:
    """With ``cfg`` and ``ps`` the tag also gets its layout and settings (read by reshape and the
    converters) and every EP rank's experts (DeepSpeed's files hold EP rank 0's only).
    ``text_files`` {name: text}: more files for the tag (the chat template a fine-tuning run used);
    ``rank_state``: the task's state of this rank (``task_state_file``), saved before the tag is complete.
    A write that fails on any rank (full disk, permission, I/O error) ends the save on every rank with
    ``CheckpointSaveFailed``: its partial folder removed, ``latest`` left at the previous checkpoint."""
    tag = tag_for(iteration)
    tag_dir = os.path.join(directory, tag)
    started = time.perf_counter()
    with WriteRecorder(engine) as writes:
        _write_tag(engine, writes, directory, tag, iteration, client_state, cfg, ps, text_files, rank_state)
    failure = agreed_failure(writes, directory)  # every rank has written (or tried) every file of this tag
    if failure is not None:
        _give_up(directory, tag, failure)
    if dist.get_rank() == 0:
        atomic_write_text(os.path.join(directory, LATEST), tag)
        if keep_last:
            prune(directory, keep_last)
        print(f"hybridlm: saved {tag} to {directory} ({human_bytes(folder_bytes(tag_dir))}, "
              f"{time.perf_counter() - started:.1f} s)", flush=True)
    dist.barrier()


def _write_tag(engine, writes: WriteRecorder, directory: str, tag: str, iteration: int, client_state: dict, cfg, ps,
               text_files: dict | None, rank_state: dict | None) -> None:
    """Every file of this rank in the tag folder, each write through ``writes`` (so a failure is recorded, not raised)."""
    tag_dir = os.path.join(directory, tag)
    # QLoRA: the frozen parameters are the base's, which the checkpoint names (write_info) instead of storing
    quantized = cfg is not None and bool(cfg.model.quant_bits)
    engine.save_checkpoint(directory, tag=tag, client_state={**client_state, "iteration": iteration}, save_latest=False,
                           exclude_frozen_parameters=quantized)
    rank = dist.get_rank()
    writes.attempt(_rng_file(directory, tag, rank), atomic_torch_save, rng_state(), _rng_file(directory, tag, rank))
    if rank_state is not None:
        path = task_state_file(tag_dir, rank)
        writes.attempt(path, atomic_torch_save, rank_state, path)
    if cfg is not None:
        writes.attempt(tag_dir, save_expert_weights, engine.module, tag_dir, Layout.of_run(cfg), ps)
        if rank == 0:
            writes.attempt(tag_dir, write_info, tag_dir, cfg, iteration, expert_files=cfg.model.num_experts is not None)
    if rank == 0:
        for name, text in (text_files or {}).items():
            writes.attempt(os.path.join(tag_dir, name), atomic_write_text, os.path.join(tag_dir, name), text)


def _give_up(directory: str, tag: str, failure: str) -> None:
    """After a failed save (every rank done with it): remove its partial folder, unless ``latest`` names it (a save
    at the latest step again), and raise the one sentence on every rank."""
    previous = latest_tag(directory)
    if dist.get_rank() == 0 and previous != tag:
        shutil.rmtree(os.path.join(directory, tag), ignore_errors=True)
    dist.barrier()
    kept = f"'{LATEST}' still names {previous}" if previous else "no checkpoint was saved before it"
    raise CheckpointSaveFailed(f"saving {tag} to --save {directory} failed, {failure}; removed the partial {tag}, {kept}; "
                               f"free space or fix the directory, then resume with --load {directory}.")


def write_run_files(directory: str, cfg, ds_config: dict) -> None:
    """The run's settings (a --config file that reproduces it) and the DeepSpeed JSON it used, in --save."""
    from ..config import effective_yaml
    os.makedirs(directory, exist_ok=True)
    atomic_write_text(os.path.join(directory, "config.yaml"), effective_yaml(cfg))
    atomic_write_text(os.path.join(directory, "ds_config.json"), json.dumps(ds_config, indent=2))


def prune(directory: str, keep_last: int) -> list[str]:
    """Delete all but the newest ``keep_last`` checkpoints up to ``latest`` (a folder newer
    than ``latest`` is a save that never completed; the next save overwrites it)."""
    current = latest_tag(directory)
    if current is None:
        return []
    limit = int(_TAG.match(current).group(1))
    steps = sorted(int(m.group(1)) for name in os.listdir(directory) if (m := _TAG.match(name)) and int(m.group(1)) <= limit)
    doomed = [tag_for(step) for step in steps[:-keep_last]]
    for name in doomed:
        shutil.rmtree(os.path.join(directory, name), ignore_errors=True)
    return doomed


def load(engine, directory: str, step: int | None, cfg=None, ps=None) -> dict | None:
    """Load ``latest`` (or ``global_step<step>``); returns the client state, or None if there is none.
    With ``cfg`` and ``ps``, a checkpoint of another layout, a weights-only one, or ``--finetune``
    goes through ``hybridlm.interop.reshape``."""
    tag = tag_to_load(directory, step)
    if tag is None:
        return None
    if not os.path.isdir(os.path.join(directory, tag)):
        raise ConfigError(f"--load {directory}: checkpoint {tag} does not exist.")
    rng_path = _rng_file(directory, tag, dist.get_rank())
    if cfg is not None and needs_reshape(os.path.join(directory, tag), cfg):
        # the random streams of the same layout carry over (--no-load-optim), of another one not
        same_layout = read_info(os.path.join(directory, tag), "--load").layout == Layout.of_run(cfg)
        keep_rng = same_layout and cfg.train.load_rng and not cfg.train.finetune and os.path.isfile(rng_path)
        client_state = load_resharded(engine, ps, cfg, os.path.join(directory, tag), rng_restored=keep_rng)
        if keep_rng:
            set_rng_state(torch.load(rng_path, weights_only=False))
        return client_state
    try:
        with torch.no_grad():  # a pipeline's load broadcasts the tied embedding again (hybridlm.model.specs.build_model)
            path, client_state = engine.load_checkpoint(directory, tag=tag)
    except (RuntimeError, EOFError, pickle.UnpicklingError, FileNotFoundError) as e:
        if isinstance(e, RuntimeError) and "PytorchStreamReader" not in str(e):
            raise
        raise ConfigError(damaged(directory, tag, str(e).splitlines()[0][:200])) from None
    if path is None:
        raise ConfigError(f"--load {directory}: DeepSpeed could not read checkpoint {tag}.")
    if cfg is not None:
        load_expert_weights(engine.module, os.path.join(directory, tag), Layout.of_run(cfg), ps)
    if cfg is not None and not cfg.train.load_rng:  # --no-load-rng: the streams stay as --seed set them
        if dist.get_rank() == 0:
            print(f"--load {directory}: --no-load-rng: random streams seeded from --seed, not restored.", flush=True)
    elif os.path.isfile(rng_path):
        set_rng_state(torch.load(rng_path, weights_only=False))  # our own file: numpy/python RNG tuples
    elif dist.get_rank() == 0:
        print(f"--load {directory}: no random state saved for this layout in {tag}; dropout streams restart.", flush=True)
    if dist.get_rank() == 0:
        print(f"--load {directory}: resumed from {tag} at iteration {client_state.get('iteration', 0)}, at the layout "
              "it was saved at.", flush=True)
    return client_state
