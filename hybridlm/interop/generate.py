"""Text generation from a checkpoint: greedy or top-k / top-p sampling, with a KV cache, under TP.

The model is the training model (``build_model`` with the TP plan, weights from any saved
layout through ``CheckpointReader``); decoding walks its blocks itself so that each step feeds
only the new token and attends to the cached keys and values of the earlier ones. Each rank
holds its TP share of heads and of the vocabulary; the last position's logits are gathered
over TP, and TP rank 0's choice is broadcast so every rank feeds the same token next.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ..model.gpt import Embedding, OutputLayer, TransformerLayer, tied_output
from ..model.specs import build_model
from ..parallel.plan import LayerFactory, ModelGroups
from ..parallel.quantized import load_quantized
from ..parallel.state import GroupHandle
from .layout import resolve_tag_dir, vocab_parameters
from .lora import open_checkpoint
from .reshape import fit_rows, load_buffers, to_local


@dataclass
class Sampling:
    """temperature 0 (or ``greedy``) picks the argmax; otherwise top-k, then top-p (nucleus), then sample."""
    greedy: bool = True
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 1234


def filter_logits(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Keep the ``top_k`` largest logits (0: all), then the smallest set whose probability reaches ``top_p``."""
    if top_k > 0:
        kth = torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        ordered, order = torch.sort(logits, descending=True, dim=-1)
        cumulative = ordered.softmax(-1).cumsum(-1)
        drop = cumulative - ordered.softmax(-1) >= top_p  # the token that crosses top_p stays
        logits = logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    return logits


class KVCache:
    """Keys and values of every layer, [batch, groups, positions, head_dim], filled left to right."""

    def __init__(self, layers: int, batch: int, groups: int, length: int, head_dim: int, device, dtype):
        shape = (batch, groups, length, head_dim)
        self.keys = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(layers)]
        self.values = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(layers)]


class Generator:
    def __init__(self, model: nn.Module, cfg, tp: GroupHandle, vocab_size: int):
        self.model, self.cfg, self.tp, self.vocab_size = model.eval(), cfg, tp, vocab_size
        funcs = list(model.forward_funcs)
        self.embedding: Embedding = model.tied_modules["embed"] if "embed" in model.tied_modules else funcs[0]
        self.layers = [f for f in funcs if isinstance(f, TransformerLayer)]
        self.final_norm = funcs[-2]
        self.head = funcs[-1]

    # ---- one forward over new tokens, positions start..start+s-1
    def _embed(self, tokens: torch.Tensor, start: int) -> torch.Tensor:
        x = self.embedding.word_embeddings(tokens.t())
        if self.embedding.position_embeddings is not None:
            x = x + self.embedding.position_embeddings[start: start + x.shape[0]].unsqueeze(1)
        return x

    def _attention(self, layer: TransformerLayer, x, cache: KVCache, index: int, start: int):
        attn = layer.attention
        q, k, v = attn.qkv(x).split(attn.qkv.local_sizes, dim=-1)
        s, b = q.shape[:2]
        q, k, v = (t.reshape(s, b, -1, attn.head_dim) for t in (q, k, v))
        if attn.rotary is not None:
            cos, sin = attn.rotary.cos_sin(start + s, x.device)
            q, k = attn.rotary.kernel(q, cos[start:], sin[start:]), attn.rotary.kernel(k, cos[start:], sin[start:])
        end = start + s
        cache.keys[index][:, :, start:end] = k.permute(1, 2, 0, 3)
        cache.values[index][:, :, start:end] = v.permute(1, 2, 0, 3)
        keys, values = cache.keys[index][:, :, :end], cache.values[index][:, :, :end]
        query = q.permute(1, 2, 0, 3)  # [b, heads, s, d]
        # query i (position start+i) sees keys 0..start+i
        mask = torch.ones(s, end, dtype=torch.bool, device=x.device).tril(diagonal=start)
        out = F.scaled_dot_product_attention(query, keys, values, attn_mask=mask,
                                             enable_gqa=query.shape[1] != keys.shape[1])
        return attn.proj(out.permute(2, 0, 1, 3).reshape(s, b, -1))

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        """Last position's logits over the real vocabulary, [batch, vocab], identical on every TP rank."""
        x = self.final_norm(x[-1:])
        local = (self.head(x) if isinstance(self.head, OutputLayer) else tied_output(self.embedding, x))[0].float()
        if self.tp.size > 1:
            parts = [torch.empty_like(local) for _ in range(self.tp.size)]
            dist.all_gather(parts, local.contiguous(), group=self.tp.group)
            local = torch.cat(parts, dim=-1)
        return local[:, : self.vocab_size]

    @torch.no_grad()
    def forward_step(self, tokens: torch.Tensor, cache: KVCache, start: int) -> torch.Tensor:
        x = self._embed(tokens, start)
        for index, layer in enumerate(self.layers):
            x = x + self._attention(layer, layer.attention_input(x), cache, index, start)
            x = x + layer.mlp(layer.mlp_input(x))
        return self._logits(x)

    # ---- decoding
    def _choose(self, logits: torch.Tensor, sampling: Sampling, generator: torch.Generator) -> torch.Tensor:
        if sampling.greedy or sampling.temperature <= 0:
            choice = logits.argmax(-1)
        else:
            filtered = filter_logits(logits / sampling.temperature, sampling.top_k, sampling.top_p)
            choice = torch.multinomial(filtered.softmax(-1), 1, generator=generator).squeeze(-1)
        if self.tp.size > 1:  # one choice for every rank, whatever rounding the ranks saw
            dist.broadcast(choice, src=dist.get_global_rank(self.tp.group, 0), group=self.tp.group)
        return choice

    @torch.no_grad()
    def generate(self, prompt: list[int], max_new_tokens: int, sampling: Sampling = Sampling(),
                 eos: Optional[int] = None) -> list[int]:
        """The new tokens after ``prompt`` (stopping after ``eos`` if given)."""
        device = next(self.model.parameters()).device
        total = len(prompt) + max_new_tokens
        if self.embedding.position_embeddings is not None and total > self.embedding.position_embeddings.shape[0]:
            raise ValueError(f"prompt + --max-new-tokens = {total} positions exceed the model's {self.embedding.position_embeddings.shape[0]}")
        first = self.layers[0].attention
        groups = first.qkv.local_sizes[1] // first.head_dim
        cache = KVCache(len(self.layers), 1, groups, total, first.head_dim, device, next(self.model.parameters()).dtype)
        generator = torch.Generator(device=device).manual_seed(sampling.seed)
        tokens = torch.tensor([prompt], device=device)
        out, start = [], 0
        for _ in range(max_new_tokens):
            logits = self.forward_step(tokens, cache, start)
            start += tokens.shape[1]
            choice = self._choose(logits, sampling, generator)
            out.append(int(choice[0]))
            if eos is not None and out[-1] == eos:
                break
            tokens = choice.view(1, 1)
        return out


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
    return Generator(model, cfg, tp, cfg.vocab_size), cfg, reader.info.settings


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
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}.get(args.dtype)
    generator, _, _ = load_for_generation(args.checkpoint, ps.tp, device(), dtype)
    sampling = Sampling(greedy=not args.sample, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed)
    eos = None if args.ignore_eos or tokenizer is None else tokenizer.eod
    results = []
    for prompt in prompts:
        new = generator.generate(prompt, args.max_new_tokens, sampling, eos=eos)
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
