"""Decoding with a KV cache through the model's own blocks, under TP: the rollouts of GRPO and
``scripts/generate.py`` both run here.

It lives beside the model (not in ``interop``) because the training loop calls it on the live
training weights: the blocks are the engine's, walked one new token at a time, each step feeding
only the new tokens and attending to the cached keys and values of the earlier ones. Each rank
holds its TP share of heads and of the vocabulary.

A batch of prompts of unequal length is right-padded: row ``i``'s prompt fills columns 0..n_i-1 of
its cache row, the prompt's prefill is one causal pass over all rows (a padding column is never
seen by a real query, and the row's logits are read at its last real column), and its new tokens
then take columns n_i, n_i+1, ... (their positions, for RoPE and learned positions alike). So each
row decodes as it would alone (what transformers' ``generate`` does with left padding and an
attention mask). The decode step has fixed shapes (``decode_state``): the cache is allocated to its
final length, each row's length lives on the device, attention reads the whole cache under a mask
built from it, and on a GPU the step is captured as a CUDA graph and replayed once per token.

The choice of a token is made on the device: greedy is the argmax; sampling without top-k / top-p is
the argmax of logits / temperature + Gumbel noise (the exponential race: the same distribution as
softmax sampling, with no sort over the vocabulary), the noise drawn from the caller's generator.
Under TP each rank offers its shard's best (value, index) and every rank takes the same best of
all, so no rank gathers the vocabulary; top-k / top-p gather the logits and filter them first.

Decoding runs on replicated activations: under sequence parallelism the linears are switched to
their plain TP form for the duration (``replicated_activations``), which computes the same
products, since one new token cannot be split over the TP ranks.

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
from .decode_state import DecodeState, StepRunner, bucket, use_graphs
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
    """Keys and values of every layer, [batch, groups, positions, head_dim]; row i's tokens at columns 0, 1, ..."""

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
    """Decoding over ``model``'s blocks (a ``SequentialModel``: PP = 1) for TP group ``tp``. ``graphs``: replay
    the decode step from CUDA graphs (None: on a GPU, unless the model has MoE layers; False: never)."""

    def __init__(self, model: nn.Module, tp: GroupHandle, vocab_size: int, graphs: Optional[bool] = None):
        self.model, self.tp, self.vocab_size, self.graphs = model, tp, vocab_size, graphs
        funcs = list(model.forward_funcs)
        self.embedding: Embedding = model.tied_modules["embed"] if "embed" in model.tied_modules else funcs[0]
        self.layers = [f for f in funcs if isinstance(f, TransformerLayer)]
        self.final_norm = funcs[-2]
        self.head = funcs[-1]
        self.rotary = self.layers[0].attention.rotary  # the layers share one RoPE

    # ---- pieces shared by the prefill and the decode step
    def _embed(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """tokens [b, s] -> [s, b, h]; ``positions`` [s] (every row's) or [1, b] (one new token per row)."""
        x = self.embedding.word_embeddings(tokens.t())
        table = self.embedding.position_embeddings
        if table is not None:
            x = x + (table[positions].unsqueeze(1) if positions.dim() == 1 else table[positions])
        return x

    def _local_logits(self, x: torch.Tensor) -> torch.Tensor:
        """Logits [b, this rank's vocabulary share] (fp32) of the last hidden states x [b, h]."""
        weight = self.head.linear.weight if isinstance(self.head, OutputLayer) else self.embedding.word_embeddings.weight
        return F.linear(self.final_norm(x), weight).float()  # no gradient here: the TP copy before the head is the identity

    def _full_logits(self, local: torch.Tensor) -> torch.Tensor:
        """[b, vocab]: the shares of every TP rank, identical on each."""
        if self.tp.size > 1:
            parts = [torch.empty_like(local) for _ in range(self.tp.size)]
            dist.all_gather(parts, local.contiguous(), group=self.tp.group)
            local = torch.cat(parts, dim=-1)
        return local[:, : self.vocab_size]

    # ---- tokens at the same columns of every row: the prompt's prefill (and the tests' stepping)
    def _chunk_attention(self, layer: TransformerLayer, x, cache: KVCache, index: int, start: int, rope):
        attn = layer.attention
        q, k, v = attn.qkv(x).split(attn.qkv.local_sizes, dim=-1)
        s, b = q.shape[:2]
        q, k, v = (t.reshape(s, b, -1, attn.head_dim) for t in (q, k, v))
        if rope is not None:
            q, k = self.rotary.kernel(q, *rope), self.rotary.kernel(k, *rope)
        end = start + s
        cache.keys[index][:b, :, start:end] = k.permute(1, 2, 0, 3)
        cache.values[index][:b, :, start:end] = v.permute(1, 2, 0, 3)
        keys, values = cache.keys[index][:b, :, :end], cache.values[index][:b, :, :end]
        query = q.permute(1, 2, 0, 3)  # [b, heads, s, d]
        mask = None if start == 0 else torch.ones(s, end, dtype=torch.bool, device=x.device).tril(diagonal=start)
        out = F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, is_causal=start == 0 and s > 1,
                                             enable_gqa=query.shape[1] != keys.shape[1])
        return attn.proj(out.permute(2, 0, 1, 3).reshape(s, b, -1))

    def _chunk_hidden(self, tokens: torch.Tensor, cache: KVCache, start: int) -> torch.Tensor:
        """Hidden states [s, b, h] of ``tokens`` [b, s] placed at columns ``start``.. of every row of ``cache``."""
        positions = torch.arange(start, start + tokens.shape[1], device=tokens.device)
        x = self._embed(tokens, positions)
        rope = self.rotary.rotation(positions) if self.rotary is not None else None
        for index, layer in enumerate(self.layers):
            x = x + self._chunk_attention(layer, layer.attention_input(x), cache, index, start, rope)
            x = x + layer.mlp(layer.mlp_input(x))
        return x

    @torch.no_grad()
    def forward_step(self, tokens: torch.Tensor, cache: KVCache, start: int) -> torch.Tensor:
        """Logits [b, vocab] after ``tokens`` [b, s] placed at columns ``start``.. of ``cache``."""
        return self._full_logits(self._local_logits(self._chunk_hidden(tokens, cache, start)[-1]))

    # ---- the decode step: one new token per row, fixed shapes (graph-captured on a GPU)
    def _decode_attention(self, layer: TransformerLayer, x, state: DecodeState, index: int, rope, mask):
        attn = layer.attention
        q, k, v = attn.qkv(x).split(attn.qkv.local_sizes, dim=-1)
        b = x.shape[1]
        q, k, v = (t.reshape(1, b, -1, attn.head_dim) for t in (q, k, v))
        if rope is not None:  # each row its own position: the PyTorch definition (the fused kernels take one table)
            q, k = reference_ops.rotary(q, *rope), reference_ops.rotary(k, *rope)
        keys, values = state.cache.keys[index], state.cache.values[index]
        slots, lengths = state.slot_ids[:b], state.lengths[:b]
        keys[slots, :, lengths] = k[0]
        values[slots, :, lengths] = v[0]
        # a KV group's queries as the query positions of one attention: no repeated keys and values
        query = q[0].reshape(b, keys.shape[1], -1, attn.head_dim)
        out = F.scaled_dot_product_attention(query, keys[:b], values[:b], attn_mask=mask)
        return attn.proj(out.reshape(1, b, -1))

    def _decode_step(self, state: DecodeState, sampling: Sampling, stops: Optional[torch.Tensor], batch: int) -> None:
        """Feed each of the first ``batch`` slots its token at its column, choose the next, record it."""
        lengths = state.lengths[:batch]
        x = self._embed(state.tokens[:batch].unsqueeze(1), lengths.unsqueeze(0))
        rope = None if state.rope is None else tuple(t[lengths].unsqueeze(0) for t in state.rope)
        mask = state.mask(batch, x.dtype)
        for index, layer in enumerate(self.layers):
            x = x + self._decode_attention(layer, layer.attention_input(x), state, index, rope, mask)
            x = x + layer.mlp(layer.mlp_input(x))
        choice = self._choose(self._local_logits(x[0]), sampling, state.noise)
        lengths += (~state.finished[:batch]).long()
        self._record(state, batch, choice, stops)

    # ---- choosing and recording tokens, on the device
    def _choose(self, local: torch.Tensor, sampling: Sampling, noise: Optional[torch.Tensor]) -> torch.Tensor:
        """The next token of each row [b] from this rank's logits [b, share]; the same on every TP rank."""
        b, share = local.shape
        gumbel = None if noise is None else -noise[:b].log()  # noise ~ Exp(1): argmax(l / T - log E) samples softmax(l / T)
        if gumbel is not None and (sampling.top_k > 0 or sampling.top_p < 1.0):
            logits = filter_logits(self._full_logits(local) / sampling.temperature, sampling.top_k, sampling.top_p)
            return (logits + gumbel[:, : self.vocab_size]).argmax(-1)
        offset = self.tp.rank * share
        valid = local[:, : max(0, min(share, self.vocab_size - offset))]  # padding rows of the vocabulary never win
        if gumbel is not None:
            valid = valid / sampling.temperature + gumbel[:, offset: offset + valid.shape[1]]
        if self.tp.size == 1:
            return valid.argmax(-1)
        if valid.shape[1]:
            index = valid.argmax(-1)
            best = torch.stack([valid.gather(-1, index.unsqueeze(1))[:, 0], (index + offset).float()])
        else:
            best = torch.stack([local.new_full((b,), float("-inf")), local.new_zeros(b)])
        parts = [torch.empty_like(best) for _ in range(self.tp.size)]
        dist.all_gather(parts, best, group=self.tp.group)  # (value, token id) of each rank's best: exact below 2**24
        every = torch.stack(parts)  # [tp, 2, b]
        winner = every[:, 0].argmax(0)  # the lowest rank among equals: the full vocabulary's argmax
        return every[:, 1].gather(0, winner.unsqueeze(0))[0].long()

    @staticmethod
    def _record(state: DecodeState, batch: int, choice: torch.Tensor, stops: Optional[torch.Tensor]) -> None:
        finished, slots = state.finished[:batch], state.slots[:batch]
        choice = choice.masked_fill(finished, state.pad_id)
        state.out.index_put_((slots, state.step.expand(batch)), choice)
        if stops is not None:
            stopped = ~finished & torch.isin(choice, stops)
            state.produced.index_put_((slots,), torch.where(stopped, state.step + 1, state.produced[slots]))
            state.ended.index_put_((slots,), state.ended[slots] | stopped)
            finished |= stopped
        state.tokens[:batch] = choice
        state.step += 1

    # ---- decoding
    def new_cache(self, batch: int, length: int) -> KVCache:
        first = self.layers[0].attention
        parameter = next(self.model.parameters())
        return KVCache(len(self.layers), batch, first.qkv.local_sizes[1] // first.head_dim, length, first.head_dim,
                       parameter.device, parameter.dtype)

    @torch.no_grad()
    def generate_batch(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, sampling: Sampling = Sampling(), *,
                       stop_ids: Sequence[int] = (), pad_id: int = 0, generator: Optional[torch.Generator] = None,
                       check_every: int = 8) -> Completions:
        """Up to ``max_new_tokens`` new tokens after each prompt, all rows decoded together, a row ending at
        its first token in ``stop_ids``. Sampling draws from ``generator`` (default: one seeded with
        ``sampling.seed``), the same draws on every TP rank. Every ``check_every`` tokens the host asks how
        many rows still decode (a device sync; between checks the steps queue up): none ends the
        decode, and few enough continue as a smaller batch."""
        device = next(self.model.parameters()).device
        lengths = [len(p) for p in prompts]
        if min(lengths) < 1:
            raise ValueError("every prompt needs at least one token")
        width, rows = max(lengths), len(prompts)
        table = self.embedding.position_embeddings
        if table is not None and width + max_new_tokens > table.shape[0]:
            raise ValueError(f"a prompt of {width} tokens + {max_new_tokens} new tokens exceed the model's {table.shape[0]} positions")
        sampled = not (sampling.greedy or sampling.temperature <= 0)
        vocabulary = self.embedding.word_embeddings.weight.shape[0] * self.tp.size
        length = -(-(width + max_new_tokens) // 64) * 64  # every column a row can reach, rounded for the kernels
        state = DecodeState(rows, length, max_new_tokens, self.new_cache(rows, length), pad_id,
                            vocabulary if sampled else 0, device)
        state.rope = None if self.rotary is None else self.rotary.rotation(state.columns)
        tokens = torch.full((rows, width), pad_id, dtype=torch.long)
        for row, prompt in enumerate(prompts):
            tokens[row, : len(prompt)] = torch.as_tensor(list(prompt), dtype=torch.long)
        state.lengths.copy_(torch.as_tensor(lengths))
        stops = torch.tensor(sorted(set(stop_ids)), dtype=torch.long, device=device) if stop_ids else None
        generator = generator or torch.Generator(device=device).manual_seed(sampling.seed)
        runner = StepRunner(lambda batch: self._decode_step(state, sampling, stops, batch), state,
                            use_graphs(self.model, device, self.graphs))
        with replicated_activations(self.model):
            hidden = self._chunk_hidden(tokens.to(device), state.cache, 0)  # the prompts' prefill
            last = hidden[state.lengths - 1, state.slot_ids]
            if sampled:
                state.noise.exponential_(generator=generator)
            self._record(state, rows, self._choose(self._local_logits(last), sampling, state.noise), stops)
            del hidden, last
            batch = rows
            for step in range(1, max_new_tokens):
                if step % check_every == 0:
                    live = state.live(batch)
                    if live == 0:
                        break
                    if bucket(live) < batch:
                        state.compact(batch, bucket(live))
                        batch = bucket(live)
                if sampled:
                    state.noise[:batch].exponential_(generator=generator)
                runner(batch)
        runner.release()
        out, produced, ended = state.out[:rows].tolist(), state.produced[:rows].tolist(), state.ended[:rows].tolist()
        return Completions([row[:n] for row, n in zip(out, produced)], [not stopped for stopped in ended])

    @torch.no_grad()
    def generate(self, prompt: list[int], max_new_tokens: int, sampling: Sampling = Sampling(),
                 eos: Optional[int] = None) -> list[int]:
        """The new tokens after ``prompt`` (stopping after ``eos`` if given)."""
        return self.generate_batch([prompt], max_new_tokens, sampling, stop_ids=() if eos is None else (eos,),
                                   check_every=1).tokens[0]
