"""Decoding with a KV cache through the model's own blocks, under TP: the rollouts of GRPO and
``scripts/generate.py`` both run here.

It lives beside the model (not in ``interop``) because the training loop calls it on the live
training weights: the blocks are the engine's, walked one new token at a time, each step feeding
only the new tokens and attending to the cached keys and values of the earlier ones. Each rank
holds its TP share of heads and of the vocabulary; the last position's logits are gathered over
TP, and TP rank 0's choice is broadcast so every rank feeds the same token next.

A batch of prompts of unequal length is left-padded: row ``i`` starts ``pad[i]`` columns late, its
tokens take positions 0, 1, ... from there (RoPE and learned positions alike), and no query attends
to a padding column, so each row decodes as it would alone (what transformers' ``generate`` does
with an attention mask). Decoding runs on replicated activations: under sequence parallelism the
linears are switched to their plain TP form for the duration (``replicated_activations``), which
computes the same products, since one new token cannot be split over the TP ranks.

How the caller readies the weights (eval mode, ZeRO-3's parameters gathered) is the caller's:
``hybridlm.training.rollout`` for training, ``hybridlm.interop.generate`` for a checkpoint.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ..ops import reference as reference_ops
from ..parallel.state import GroupHandle
from .gpt import Embedding, OutputLayer, TransformerLayer


@dataclass
class Sampling:
    """temperature 0 (or ``greedy``) picks the argmax; otherwise top-k, then top-p (nucleus), then sample."""
    greedy: bool = True
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 1234


@dataclass
class Completions:
    """What ``generate_batch`` returns: each row's new tokens (a stop token, when one came, last) and
    whether it stopped by reaching the token budget instead (truncated)."""
    tokens: list = field(default_factory=list)
    truncated: list = field(default_factory=list)


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


@contextlib.contextmanager
def replicated_activations(model: nn.Module):
    """Run ``model``'s linears on whole (replicated) activations: sequence parallelism off for the
    duration (the same products, without the sequence all-gather and reduce-scatter that one new
    token cannot take part in)."""
    switched = [m for m in model.modules() if getattr(m, "sequence_parallel", False) is True]
    for module in switched:
        module.sequence_parallel = False
    try:
        yield
    finally:
        for module in switched:
            module.sequence_parallel = True


class Generator:
    """Decoding over ``model``'s blocks (a ``SequentialModel``: PP = 1) for TP group ``tp``."""

    def __init__(self, model: nn.Module, tp: GroupHandle, vocab_size: int):
        self.model, self.tp, self.vocab_size = model, tp, vocab_size
        funcs = list(model.forward_funcs)
        self.embedding: Embedding = model.tied_modules["embed"] if "embed" in model.tied_modules else funcs[0]
        self.layers = [f for f in funcs if isinstance(f, TransformerLayer)]
        self.final_norm = funcs[-2]
        self.head = funcs[-1]

    # ---- one forward over new tokens [b, s] at columns start..start+s-1
    def _positions(self, s: int, start: int, pad: Optional[torch.Tensor], device) -> torch.Tensor:
        """Positions [s] shared by every row, or [b, s] when rows are left-padded (``pad``: columns each row starts late)."""
        columns = torch.arange(start, start + s, device=device)
        return columns if pad is None else (columns.unsqueeze(0) - pad.unsqueeze(1)).clamp_min(0)

    def _embed(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.embedding.word_embeddings(tokens.t())
        table = self.embedding.position_embeddings
        if table is not None:
            x = x + (table[positions].unsqueeze(1) if positions.dim() == 1 else table[positions.t()])
        return x

    def _mask(self, s: int, start: int, pad: Optional[torch.Tensor], device) -> torch.Tensor:
        """Which cached columns each new query sees: causal, and never a padding column (a padding
        query sees itself, so that no softmax is empty; its output is never used)."""
        end = start + s
        causal = torch.ones(s, end, dtype=torch.bool, device=device).tril(diagonal=start)
        if pad is None:
            return causal
        real = torch.arange(end, device=device).unsqueeze(0) >= pad.unsqueeze(1)  # [b, end]
        if s == 1:  # a decoding step: its query is a real token, and every cached column is causal to it
            return real[:, None, None, :]
        itself = torch.zeros(s, end, dtype=torch.bool, device=device)
        itself[torch.arange(s), torch.arange(start, end)] = True
        return ((causal & real.unsqueeze(1)) | itself).unsqueeze(1)  # [b, 1, s, end]

    def _rope(self, positions: torch.Tensor):
        """(cos, sin, how to apply them) for ``positions``, computed once per forward for every layer (the
        layers share one RoPE): what ``Rotary.apply`` computes per call; None without RoPE."""
        rotary = self.layers[0].attention.rotary
        if rotary is None:
            return None
        if positions.dim() == 1:
            return (*rotary.rotation(positions), rotary.kernel)
        return (*rotary.rotation(positions.t()), reference_ops.rotary)

    def _attention(self, layer: TransformerLayer, x, cache: KVCache, index: int, start: int, rope, mask):
        attn = layer.attention
        q, k, v = attn.qkv(x).split(attn.qkv.local_sizes, dim=-1)
        s, b = q.shape[:2]
        q, k, v = (t.reshape(s, b, -1, attn.head_dim) for t in (q, k, v))
        if rope is not None:
            cos, sin, rotate = rope
            q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        end = start + s
        cache.keys[index][:, :, start:end] = k.permute(1, 2, 0, 3)
        cache.values[index][:, :, start:end] = v.permute(1, 2, 0, 3)
        keys, values = cache.keys[index][:, :, :end], cache.values[index][:, :, :end]
        query = q.permute(1, 2, 0, 3)  # [b, heads, s, d]
        out = F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, enable_gqa=query.shape[1] != keys.shape[1])
        return attn.proj(out.permute(2, 0, 1, 3).reshape(s, b, -1))

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        """Last position's logits over the real vocabulary, [batch, vocab], identical on every TP rank."""
        x = self.final_norm(x[-1:])
        weight = self.head.linear.weight if isinstance(self.head, OutputLayer) else self.embedding.word_embeddings.weight
        local = F.linear(x, weight)[0].float()  # no gradient here: the TP copy before the head is the identity
        if self.tp.size > 1:
            parts = [torch.empty_like(local) for _ in range(self.tp.size)]
            dist.all_gather(parts, local.contiguous(), group=self.tp.group)
            local = torch.cat(parts, dim=-1)
        return local[:, : self.vocab_size]

    @torch.no_grad()
    def forward_step(self, tokens: torch.Tensor, cache: KVCache, start: int, pad: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Logits [b, vocab] after ``tokens`` [b, s] placed at columns ``start``.. of ``cache``; ``pad``
        [b]: how many columns each row starts late (left padding), None when none does."""
        positions = self._positions(tokens.shape[1], start, pad, tokens.device)
        mask = self._mask(tokens.shape[1], start, pad, tokens.device)
        x = self._embed(tokens, positions)
        rope = self._rope(positions)
        for index, layer in enumerate(self.layers):
            x = x + self._attention(layer, layer.attention_input(x), cache, index, start, rope, mask)
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

    def new_cache(self, batch: int, length: int) -> KVCache:
        first = self.layers[0].attention
        parameter = next(self.model.parameters())
        return KVCache(len(self.layers), batch, first.qkv.local_sizes[1] // first.head_dim, length, first.head_dim,
                       parameter.device, parameter.dtype)

    @torch.no_grad()
    def generate_batch(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, sampling: Sampling = Sampling(), *,
                       stop_ids: Sequence[int] = (), pad_id: int = 0, generator: Optional[torch.Generator] = None,
                       check_every: int = 8) -> Completions:
        """Up to ``max_new_tokens`` new tokens after each prompt, all rows decoded together (left-padded),
        a row ending at its first token in ``stop_ids``. Sampling draws from ``generator`` (default: one
        seeded with ``sampling.seed``), the same draws on every TP rank. Every ``check_every`` tokens the
        host asks whether all rows have stopped (a device sync; between checks the steps queue up)."""
        device = next(self.model.parameters()).device
        lengths = [len(p) for p in prompts]
        if min(lengths) < 1:
            raise ValueError("every prompt needs at least one token")
        width, rows = max(lengths), len(prompts)
        table = self.embedding.position_embeddings
        if table is not None and width + max_new_tokens > table.shape[0]:
            raise ValueError(f"a prompt of {width} tokens + {max_new_tokens} new tokens exceed the model's {table.shape[0]} positions")
        pad = torch.tensor([width - n for n in lengths], device=device)
        tokens = torch.full((rows, width), pad_id, dtype=torch.long, device=device)
        for row, prompt in enumerate(prompts):
            tokens[row, width - len(prompt):] = torch.as_tensor(list(prompt), dtype=torch.long)
        padded = pad if bool((pad > 0).any()) else None
        generator = generator or torch.Generator(device=device).manual_seed(sampling.seed)
        stops = torch.tensor(sorted(set(stop_ids)), dtype=torch.long, device=device)
        out = torch.full((rows, max_new_tokens), pad_id, dtype=torch.long, device=device)
        finished = torch.zeros(rows, dtype=torch.bool, device=device)
        produced = torch.full((rows,), max_new_tokens, dtype=torch.long, device=device)
        cache = self.new_cache(rows, width + max_new_tokens)
        with replicated_activations(self.model):
            logits = self.forward_step(tokens, cache, 0, padded)
            for step in range(max_new_tokens):
                choice = self._choose(logits, sampling, generator).masked_fill(finished, pad_id)
                out[:, step] = choice
                stopped = ~finished & torch.isin(choice, stops)
                produced = torch.where(stopped, step + 1, produced)
                finished |= stopped
                if step + 1 == max_new_tokens or ((step + 1) % check_every == 0 and bool(finished.all())):
                    break
                logits = self.forward_step(choice.unsqueeze(1), cache, width + step, padded)
        produced, finished, out = produced.tolist(), finished.tolist(), out.tolist()
        return Completions([row[:n] for row, n in zip(out, produced)], [not done for done in finished])

    @torch.no_grad()
    def generate(self, prompt: list[int], max_new_tokens: int, sampling: Sampling = Sampling(),
                 eos: Optional[int] = None) -> list[int]:
        """The new tokens after ``prompt`` (stopping after ``eos`` if given)."""
        return self.generate_batch([prompt], max_new_tokens, sampling, stop_ids=() if eos is None else (eos,),
                                   check_every=1).tokens[0]
