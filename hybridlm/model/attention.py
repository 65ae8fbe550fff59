"""Rotary position embeddings (the attention kernels live in ``attention_backends``)."""
from __future__ import annotations

import torch

from ..ops import reference as reference_ops


def _tables(positions: torch.Tensor, head_dim: int, base: float) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=positions.device) / head_dim))
    angles = positions.to(torch.float32).unsqueeze(-1) * inv_freq
    emb = torch.cat([angles, angles], dim=-1)
    return emb.cos(), emb.sin()


@torch.library.custom_op("hybridlm::rotary_tables", mutates_args=())
def rotary_tables(positions: torch.Tensor, head_dim: int, base: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [..., head_dim] (fp32) of integer ``positions``, as one op a compiled graph cannot see into.

    Why opaque: traced, the tables' few elementwise ops (a power, a reciprocal, cos, sin) are inlined by Inductor into
    the rotation kernels that read them, which then compute them again for every element of q and k, forward and
    backward: batch x heads times the [s, d] work. On one H200 those kernels took 227 ms of the reference model's
    1,197 ms FP8 step. Here they run once per call, as their own small kernels."""
    return _tables(positions, head_dim, base)


@rotary_tables.register_fake
def _(positions, head_dim, base):
    shape = (*positions.shape, head_dim)
    return positions.new_empty(shape, dtype=torch.float32), positions.new_empty(shape, dtype=torch.float32)


class Rotary:
    """RoPE in the Llama / Hugging Face layout (rotate the two halves of each head).
    cos/sin are computed in fp32 and cached per (length, device); not a module buffer,
    so a bf16 cast of the model never rounds the frequencies. ``kernel`` applies them
    (hybridlm.ops: a fused kernel, or the PyTorch definition). Each token is rotated by its
    position: the one the batch gives it (packed samples restart at 0; under context parallelism
    a rank's rows are slices of the sequence), else its row index 0..length-1."""

    def __init__(self, head_dim: int, base: float, kernel=reference_ops.rotary):
        self.head_dim, self.base, self.kernel = head_dim, float(base), kernel
        self._cache: dict = {}

    def rotation(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [..., d] (fp32) of integer ``positions`` of any shape."""
        if torch.compiler.is_compiling():
            return rotary_tables(positions, self.head_dim, self.base)
        return _tables(positions, self.head_dim, self.base)

    def cos_sin(self, seq_len: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [s, d] of positions 0..seq_len-1. Inside a compiled graph they are computed (by the opaque op),
        not cached: filling the cache there made dynamo guard on the cache's contents, so each compiled layer
        compiled a second time at its second call."""
        if torch.compiler.is_compiling():
            return self.rotation(torch.arange(seq_len, device=device))
        key = (seq_len, str(device))
        if key not in self._cache:
            self._cache = {key: self.rotation(torch.arange(seq_len, device=device))}
        return self._cache[key]

    def tables(self, seq_len: int, device, position_ids: torch.Tensor | None = None) -> tuple:
        """What ``apply`` rotates by, computed once for q and k: cos, sin [s, d] (one table for every row), or [s, b, d]
        when ``position_ids`` is [b, s] (each row its own: packed samples, whose positions restart)."""
        if position_ids is None:
            return self.cos_sin(seq_len, device)
        return self.rotation(position_ids if position_ids.dim() == 1 else position_ids.t())

    def apply(self, x: torch.Tensor, tables: tuple) -> torch.Tensor:
        """x: [s, b, heads, d] rotated by ``tables`` (from ``tables()``); per-row tables take the PyTorch definition: the fused
        kernels take one position table for all rows."""
        cos, sin = tables
        return self.kernel(x, cos, sin) if cos.dim() == 2 else reference_ops.rotary(x, cos, sin)
