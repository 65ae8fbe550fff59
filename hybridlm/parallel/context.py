"""Context parallelism (CP): each rank of a CP group holds a slice of every sample's sequence,
and attention, the only layer that mixes positions, sees the whole sequence through one of:

  p2p        ring attention: K/V blocks travel around the ring (send/recv overlapped with the
             block in hand), partial outputs merged exactly by their log-sum-exp; the backward
             runs the ring again with dK/dV travelling along and arriving home at the end, so
             the full sequence is never materialised on any rank.
  a2a        all-to-all (DeepSpeed-Ulysses): from sequence-sharded to head-sharded, any
             attention kernel over the whole sequence on H/CP heads, and back. With grouped-query
             attention the K/V heads are replicated when there are fewer than CP per rank. Packed
             samples stay apart as without CP (the kernel sees the whole rows' position ids); the
             two block-wise types would need the sample boundaries in every block, so packing is
             refused with them.
  allgather  K/V all-gathered; each local query chunk attends to its causal prefix.

The layout (Megatron's load balance): the sequence is cut into 2 x CP chunks and rank i holds
chunks i and 2CP-1-i, in that order, so under the causal mask every rank does the same work.
``load_balanced_positions`` is the one definition of that layout: the data side slices samples
with it, RoPE rotates by it, and the ring's masks assume it.

Gradients: to DeepSpeed a CP rank is a data-parallel replica and its gradients are averaged over
DP x CP. Every collective here therefore has its true adjoint as backward (ring dK/dV home,
all-to-all back, all-gather <-> reduce-scatter, and an all-reduce whose backward is again an
all-reduce, ``sum_over_context_parallel``, for the loss and the MoE balance statistics), which
makes each rank's gradient CP times its share of the single-process gradient: the average over
CP is then exactly the single-process gradient.

Block kernels (``hybridlm.model.attention_backends``) take q [sq, b, h, d] and k, v [sk, b, g, d]
and return out [sq, b, h, d] with lse [b, h, sq] (fp32); their backward takes the *final* output
and log-sum-exp, as flash attention's does, so a block's gradient needs nothing from the merge.
"""
from __future__ import annotations

import math
from typing import Callable

import torch
import torch.distributed as dist

from .sequence import gather_from_sequence
from .state import GroupHandle

COMM_TYPES = ("p2p", "a2a", "allgather")


# ---------------------------------------------------------------- the layout

def load_balanced_positions(seq_length: int, rank: int, size: int, device=None) -> torch.Tensor:
    """Global positions of CP rank ``rank``'s tokens, in its local order: chunk ``rank`` then
    chunk ``2 size - 1 - rank`` of the sequence cut into ``2 size`` equal chunks."""
    chunk = seq_length // (2 * size)
    if chunk * 2 * size != seq_length:
        raise ValueError(f"sequence length {seq_length} is not divisible by 2 x CP = {2 * size}")
    first, second = rank * chunk, (2 * size - 1 - rank) * chunk
    return torch.cat([torch.arange(first, first + chunk, device=device), torch.arange(second, second + chunk, device=device)])


def slice_for_rank(x: torch.Tensor, dim: int, rank: int, size: int) -> torch.Tensor:
    """This CP rank's tokens of a full-sequence tensor (sequence along ``dim``)."""
    if size == 1:
        return x
    return x.index_select(dim, load_balanced_positions(x.shape[dim], rank, size, device=x.device))


def _gathered_positions(local_length: int, size: int, device) -> torch.Tensor:
    """Global position of each row of a sequence gathered rank after rank (rank 0's rows first)."""
    return torch.cat([load_balanced_positions(local_length * size, r, size, device=device) for r in range(size)])


# ---------------------------------------------------------------- the loss and other sums over CP

class _SumOverContextParallel(torch.autograd.Function):
    """All-reduce whose backward is the all-reduce of the gradients (the true adjoint when every
    rank goes on with the sum): see the module docstring for why CP wants that one."""

    @staticmethod
    def forward(ctx, x, cp):
        ctx.cp = cp
        x = x.clone()
        dist.all_reduce(x, group=cp.group)
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.cp.group)
        return grad, None


def sum_over_context_parallel(x: torch.Tensor, cp: GroupHandle) -> torch.Tensor:
    return x if cp.size == 1 else _SumOverContextParallel.apply(x, cp)


# ---------------------------------------------------------------- blocks and their merge

def _rows_last(lse: torch.Tensor) -> torch.Tensor:
    """lse [b, h, s] -> [s, b, h, 1], to weigh outputs [s, b, h, d]."""
    return lse.permute(2, 0, 1).unsqueeze(-1)


def accumulation_dtype(t: torch.Tensor) -> torch.dtype:
    """fp32, or the tensor's own dtype when wider: merges and gradient sums never round to bf16."""
    return torch.promote_types(t.dtype, torch.float32)


def merge_blocks(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor):
    """Softmax over the union of two key sets from each one's normalised output and log-sum-exp:
    out = (e^lse out + e^lse' out') / (e^lse + e^lse'), in ``out``'s (accumulation) dtype."""
    merged = torch.logaddexp(lse, block_lse)
    out = out * torch.exp(_rows_last(lse - merged)) + block_out.to(out.dtype) * torch.exp(_rows_last(block_lse - merged))
    return out, merged


class MergedBlocks:
    """The running fp32 output and log-sum-exp of a query block, merged block by block."""

    def __init__(self):
        self.out = self.lse = None

    def add(self, rows: slice, block_out: torch.Tensor, block_lse: torch.Tensor, total_rows: int) -> None:
        if self.out is None:
            shape = (total_rows, *block_out.shape[1:])
            self.out = torch.zeros(shape, dtype=accumulation_dtype(block_out), device=block_out.device)
            self.lse = torch.full((*block_lse.shape[:2], total_rows), float("-inf"), dtype=block_lse.dtype, device=block_out.device)
        out, lse = merge_blocks(self.out[rows], self.lse[..., rows], block_out, block_lse)
        self.out[rows], self.lse[..., rows] = out, lse


Block = tuple[slice, slice, bool]  # (query rows, key rows, causal)


def _attend(kernel, merged: MergedBlocks, q, k, v, block: Block) -> None:
    q_rows, k_rows, causal = block
    out, lse = kernel.forward(q[q_rows], k[k_rows], v[k_rows], causal)
    merged.add(q_rows, out, lse, q.shape[0])


def _attend_backward(kernel, dout, q, k, v, out, lse, block: Block, dq, dk, dv) -> None:
    """Add one block's gradients into dq (its query rows) and dk, dv (its key rows), from the
    merged output and log-sum-exp."""
    q_rows, k_rows, causal = block
    block_dq, block_dk, block_dv = kernel.backward(dout[q_rows], q[q_rows], k[k_rows], v[k_rows], out[q_rows],
                                                   lse[..., q_rows], causal)
    dq[q_rows] += block_dq
    dk[k_rows] += block_dk
    dv[k_rows] += block_dv


# ---------------------------------------------------------------- p2p: ring attention

def _peers(cp: GroupHandle) -> tuple[int, int]:
    """Global ranks of the next and previous CP ranks on the ring."""
    return (dist.get_global_rank(cp.group, (cp.rank + 1) % cp.size),
            dist.get_global_rank(cp.group, (cp.rank - 1) % cp.size))


class _Exchange:
    """Send a tensor to the next rank and receive the previous rank's, asynchronously."""

    def __init__(self, tensor: torch.Tensor, cp: GroupHandle, tag: int):
        nxt, prev = _peers(cp)
        self.received = torch.empty_like(tensor)
        self._sent = tensor  # must stay alive until the send completes
        self._requests = dist.batch_isend_irecv([dist.P2POp(dist.isend, tensor, nxt, cp.group, tag),
                                                 dist.P2POp(dist.irecv, self.received, prev, cp.group, tag)])

    def wait(self) -> torch.Tensor:
        for request in self._requests:
            request.wait()
        return self.received


_KV_TAG, _DKV_TAG = 11, 12


def ring_block(step: int, rank: int, size: int, half: int) -> Block:
    """(query rows, key rows, causal) for the K/V of rank ``rank - step`` under the load-balanced
    layout: at step 0 the rank's own K/V (its two chunks, causally); from an earlier rank only that
    rank's first chunk is visible, to all local queries; from a later rank both its chunks are
    visible, to the second local chunk only."""
    source = (rank - step) % size
    if step == 0:
        return slice(None), slice(None), True
    if source < rank:
        return slice(None), slice(0, half), False
    return slice(half, None), slice(None), False


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cp: GroupHandle, kernel):
        size, rank, half = cp.size, cp.rank, q.shape[0] // 2
        kv = torch.stack([k, v])  # one message per step
        merged = MergedBlocks()
        for step in range(size):
            incoming = _Exchange(kv, cp, _KV_TAG) if step + 1 < size else None
            _attend(kernel, merged, q, kv[0], kv[1], ring_block(step, rank, size, half))
            if incoming is not None:
                kv = incoming.wait()
        out = merged.out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, merged.lse)
        ctx.cp, ctx.kernel = cp, kernel
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        cp, kernel = ctx.cp, ctx.kernel
        size, rank, half = cp.size, cp.rank, q.shape[0] // 2
        dout = dout.contiguous()
        dq = torch.zeros_like(q, dtype=accumulation_dtype(q))
        kv = torch.stack([k, v])
        home = None  # the exchange carrying each K/V's gradient one rank further
        for step in range(size):
            incoming = _Exchange(kv, cp, _KV_TAG) if step + 1 < size else None
            # the gradient of the K/V in hand: what the ranks before added, plus this block's
            dkv = torch.zeros_like(kv, dtype=accumulation_dtype(kv)) if home is None else home.wait()
            _attend_backward(kernel, dout, q, kv[0], kv[1], out, lse, ring_block(step, rank, size, half), dq, dkv[0], dkv[1])
            home = _Exchange(dkv, cp, _DKV_TAG)  # after the last step this lands on its owner
            if incoming is not None:
                kv = incoming.wait()
        dkv = home.wait()
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None


def ring_attention(q, k, v, cp: GroupHandle, kernel) -> torch.Tensor:
    """Causal attention over the whole sequence of q, k, v [s_local, b, heads, d] laid out by
    ``load_balanced_positions``; returns this rank's rows."""
    return _RingAttention.apply(q, k, v, cp, kernel)


# ---------------------------------------------------------------- allgather: local queries, gathered keys

class _PrefixAttention(torch.autograd.Function):
    """Local query chunks against the whole (gathered, natural-order) K/V: chunk ``t`` attends
    to chunks 0..t-1 entirely and to chunk t causally, two blocks merged by log-sum-exp."""

    @staticmethod
    def forward(ctx, q, k, v, chunks: tuple[int, int], kernel):
        blocks = _prefix_blocks(chunks, q.shape[0] // 2)
        merged = MergedBlocks()
        for block in blocks:
            _attend(kernel, merged, q, k, v, block)
        out = merged.out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, merged.lse)
        ctx.blocks, ctx.kernel = blocks, kernel
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        dout = dout.contiguous()
        dq = torch.zeros_like(q, dtype=accumulation_dtype(q))
        dk, dv = torch.zeros_like(k, dtype=accumulation_dtype(k)), torch.zeros_like(v, dtype=accumulation_dtype(v))
        for block in ctx.blocks:
            _attend_backward(ctx.kernel, dout, q, k, v, out, lse, block, dq, dk, dv)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None


def _prefix_blocks(chunks: tuple[int, int], chunk: int) -> list[Block]:
    blocks = []
    for local, t in enumerate(chunks):
        rows = slice(local * chunk, (local + 1) * chunk)
        if t > 0:
            blocks.append((rows, slice(0, t * chunk), False))
        blocks.append((rows, slice(t * chunk, (t + 1) * chunk), True))
    return blocks


def allgather_attention(q, k, v, cp: GroupHandle, kernel) -> torch.Tensor:
    """K/V gathered over CP (backward: reduce-scatter), put in natural order; local queries attend."""
    gathered = _gathered_positions(k.shape[0], cp.size, k.device)
    natural = torch.argsort(gathered)
    k_all = gather_from_sequence(k, cp).index_select(0, natural)
    v_all = gather_from_sequence(v, cp).index_select(0, natural)
    return _PrefixAttention.apply(q, k_all, v_all, (cp.rank, 2 * cp.size - 1 - cp.rank), kernel)


# ---------------------------------------------------------------- a2a: Ulysses

def _sequence_to_heads(x: torch.Tensor, cp: GroupHandle) -> torch.Tensor:
    """[s, b, H, d] (this rank's rows, all heads) -> [CP s, b, H/CP, d] (every rank's rows, rank
    after rank, this rank's share of the heads)."""
    s, b, heads, d = x.shape
    send = x.reshape(s, b, cp.size, heads // cp.size, d).permute(2, 0, 1, 3, 4).contiguous()
    received = torch.empty_like(send)
    dist.all_to_all_single(received, send, group=cp.group)
    return received.reshape(cp.size * s, b, heads // cp.size, d)


def _heads_to_sequence(x: torch.Tensor, cp: GroupHandle) -> torch.Tensor:
    """The inverse of ``_sequence_to_heads``."""
    rows, b, heads, d = x.shape
    send = x.reshape(cp.size, rows // cp.size, b, heads, d).contiguous()
    received = torch.empty_like(send)
    dist.all_to_all_single(received, send, group=cp.group)
    return received.permute(1, 2, 0, 3, 4).reshape(rows // cp.size, b, cp.size * heads, d)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, cp: GroupHandle, to_heads: bool):
        ctx.cp, ctx.to_heads = cp, to_heads
        return _sequence_to_heads(x, cp) if to_heads else _heads_to_sequence(x, cp)

    @staticmethod
    def backward(ctx, grad):
        return (_heads_to_sequence(grad, ctx.cp) if ctx.to_heads else _sequence_to_heads(grad, ctx.cp)), None, None


def kv_replication(groups: int, cp: int) -> int:
    """How many copies of each K/V head make the heads split evenly over CP while every query
    head keeps its own K/V head: lcm(groups, CP) / groups."""
    return cp // math.gcd(groups, cp)


def _whole_rows(position_ids: torch.Tensor, cp: GroupHandle, natural: torch.Tensor) -> torch.Tensor:
    """The whole rows' position ids [b, s] (natural order) from each rank's slice [b, s / CP]."""
    parts = [torch.empty_like(position_ids) for _ in range(cp.size)]
    dist.all_gather(parts, position_ids.contiguous(), group=cp.group)
    return torch.cat(parts, dim=1).index_select(1, natural)


def ulysses_attention(q, k, v, cp: GroupHandle, core: Callable, dropout_p: float = 0.0, position_ids=None) -> torch.Tensor:
    """All-to-all to H/CP heads over the whole (natural-order) sequence, ``core`` there, and back.
    Packed samples (``position_ids`` [b, s / CP], this rank's slice) stay apart: the core sees the
    whole rows' position ids, as without CP."""
    copies = kv_replication(k.shape[2], cp.size)
    if copies > 1:  # grouped-query attention with fewer K/V heads than CP ranks
        k, v = k.repeat_interleave(copies, dim=2), v.repeat_interleave(copies, dim=2)
    gathered = _gathered_positions(q.shape[0], cp.size, q.device)
    natural = torch.argsort(gathered)
    q, k, v = (_AllToAll.apply(t, cp, True).index_select(0, natural) for t in (q, k, v))
    out = core(q, k, v, dropout_p, None if position_ids is None else _whole_rows(position_ids, cp, natural))
    return _AllToAll.apply(out.index_select(0, gathered), cp, False)


# ---------------------------------------------------------------- what the model calls

class ContextParallelAttention:
    """The attention core under CP: same signature as a plain core, (q, k, v, dropout_p, position
    ids) -> out, on this rank's rows (position ids: packed samples, a2a only). ``core``: the plain kernel (a2a runs it on whole sequences);
    ``block_kernel``: the log-sum-exp variant (p2p and allgather run it block by block)."""

    def __init__(self, cp: GroupHandle, comm_type: str, core: Callable, block_kernel):
        if comm_type not in COMM_TYPES:
            raise ValueError(f"unknown CP communication {comm_type!r}; have {', '.join(COMM_TYPES)}")
        self.cp, self.comm_type, self.core, self.block_kernel = cp, comm_type, core, block_kernel

    def __call__(self, q, k, v, dropout_p: float = 0.0, position_ids=None):
        if self.comm_type == "a2a":
            return ulysses_attention(q, k, v, self.cp, self.core, dropout_p, position_ids)
        if dropout_p:
            raise ValueError(f"--cp-comm-type {self.comm_type} has no attention dropout")
        if position_ids is not None:  # the config refuses this before any process group
            raise ValueError(f"--cp-comm-type {self.comm_type} cannot keep packed samples apart; use a2a")
        if self.comm_type == "p2p":
            return ring_attention(q, k, v, self.cp, self.block_kernel)
        return allgather_attention(q, k, v, self.cp, self.block_kernel)
