"""Text generation from a checkpoint: greedy or top-k / top-p sampling, with a KV cache, under TP.

The model is the training model (``build_model`` with the TP plan, weights from any saved
layout through ``CheckpointReader``); the decoding itself is ``hybridlm.model.generation``'s,
which GRPO's rollouts run on the live training weights.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from ..model.generation import Completions, Generator, KVCache, Sampling, filter_logits  # noqa: F401 - the script's names
from ..model.specs import build_model
from ..parallel.plan import LayerFactory, ModelGroups
from ..parallel.quantized import DTYPES, load_quantized
from ..parallel.state import GroupHandle
from .layout import resolve_tag_dir, vocab_parameters
from .lora import open_checkpoint
from .reshape import fit_rows, load_buffers, to_local


def load_for_generation(checkpoint: str, tp: GroupHandle, device, dtype: Optional[torch.dtype] = None):
    """(Generator, model config, checkpoint settings) for ``checkpoint`` at TP = ``tp.size``; weights
    come from any saved layout, each rank reading only its own slices."""
    reader = open_checkpoint(resolve_tag_dir(checkpoint))  # a QLoRA checkpoint joined with the base it names
    cfg = reader.model_config
    cfg.padded_vocab_size = cfg.pad_vocab(tp.size)
    if cfg.num_attention_heads % tp.size or cfg.num_query_groups % tp.size:
        raise ValueError(f"--tp {tp.size} does not divide the model's {cfg.num_attention_heads} heads / {cfg.num_query_groups} groups")
    saved = reader.weight(reader.names()[0])
    dtype = dtype or (saved.dtype if saved.is_floating_point() else torch.float32)
    model = build_model(cfg, LayerFactory(ModelGroups(tp=tp), device=device, dtype=dtype))
    vocab = vocab_parameters(cfg)
    with torch.no_grad():
        for name, param in model.named_parameters():
            full = reader.weight(name)
            if name in vocab:
                full = fit_rows(full, cfg.padded_vocab_size)
            param.copy_(to_local(full, param, _TPOnly(tp)).to(param.dtype))
    load_quantized(model, reader.weight)  # QLoRA: the 4-bit base, quantized as in training
    load_buffers(model, reader)
    return Generator(model.eval(), tp, cfg.vocab_size), cfg, reader.info.settings


@dataclass
class _TPOnly:
    tp: GroupHandle
    ep: GroupHandle = GroupHandle(None, 0, 1)


def generate_from_flags(args) -> int:
    """scripts/generate.py after argument parsing: bad input is one sentence and exit code 2 before
    any process group exists; then TP = the launched ranks, and rank 0 prints (and writes JSON)."""
    import json
    import sys

    from ..config import ConfigError, world_size_from_env
    from ..data.tokenizers import build_tokenizer
    from ..parallel.state import ParallelState
    from ..training.distributed import device, init_distributed
    from .layout import read_info

    try:
        info = read_info(resolve_tag_dir(args.checkpoint))
        cfg, tp = info.model_config(), world_size_from_env()
        if cfg.num_attention_heads % tp or cfg.num_query_groups % tp:
            raise ConfigError(f"{tp} ranks (TP) do not divide the model's {cfg.num_attention_heads} attention heads "
                              f"and {cfg.num_query_groups} key/value groups.")
        tokenizer = None
        if args.prompt or not args.ignore_eos:
            s = info.settings
            tokenizer = build_tokenizer(s.get("tokenizer_type") or "ByteTokenizer", s.get("tokenizer_model"),
                                        s.get("vocab_file"), s.get("merge_file"))
        prompts = [tokenizer.encode(p) for p in args.prompt] + list(args.prompt_ids)
        for prompt in prompts:
            if not prompt or any(not 0 <= t < cfg.vocab_size for t in prompt):
                raise ConfigError(f"a prompt is empty or has token ids outside the vocabulary 0..{cfg.vocab_size - 1}.")
            if cfg.position_embedding_type == "learned_absolute" and len(prompt) + args.max_new_tokens > cfg.max_position_embeddings:
                raise ConfigError(f"a prompt of {len(prompt)} tokens + --max-new-tokens {args.max_new_tokens} exceeds the "
                                  f"model's {cfg.max_position_embeddings} positions.")
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    init_distributed(timeout_minutes=10)
    ps = ParallelState(tp=dist.get_world_size())
    dtype = DTYPES.get(args.dtype)
    generator, _, _ = load_for_generation(args.checkpoint, ps.tp, device(), dtype)
    sampling = Sampling(greedy=not args.sample, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed)
    eos = None if args.ignore_eos or tokenizer is None else tokenizer.eod
    results = []  # every prompt decoded in one batch
    completions = generator.generate_batch(prompts, args.max_new_tokens, sampling, stop_ids=() if eos is None else (eos,))
    for prompt, new in zip(prompts, completions.tokens):
        results.append({"prompt_ids": prompt, "generated_ids": new})
        if dist.get_rank() == 0:
            text = tokenizer.decode(new) if tokenizer is not None else " ".join(map(str, new))
            print(f"--- prompt {len(results)} ({len(prompt)} tokens) -> {len(new)} tokens\n{text}", flush=True)
    if dist.get_rank() == 0 and args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(results, f)
    dist.barrier()
    dist.destroy_process_group()
    return 0
