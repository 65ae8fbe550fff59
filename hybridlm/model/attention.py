"""Rotary position embeddings (the attention kernels live in ``attention_backends``)."""
from __future__ import annotations

import torch

from ..ops import reference as reference_ops


class Rotary:
    """RoPE in the Llama / Hugging Face layout (rotate the two halves of each head).
    cos/sin are computed in fp32 and cached per (length, device); not a module buffer,
    so a bf16 cast of the model never rounds the frequencies. ``kernel`` applies them
    (hybridlm.ops: a fused kernel, or the PyTorch definition). Each token is rotated by its
    position: the one the batch gives it (packed samples restart at 0; under context parallelism
    a rank's rows are slices of the sequence), else its row index 0..length-1."""

    def __init__(self, head_dim: int, base: float, kernel=reference_ops.rotary):
        self.head_dim, self.base, self.kernel = head_dim, base, kernel
        self._cache: dict = {}

    def rotation(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [..., d] (fp32) of integer ``positions`` of any shape."""
        inv_freq = 1.0 / (self.base ** (torch.arange(0, self.head_dim, 2, dtype=torch.float32, device=positions.device) / self.head_dim))
        angles = positions.to(torch.float32).unsqueeze(-1) * inv_freq
        emb = torch.cat([angles, angles], dim=-1)
        return emb.cos(), emb.sin()

    def cos_sin(self, seq_len: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [s, d] of positions 0..seq_len-1. Inside a compiled graph they are computed, not cached: filling
        the cache there made dynamo guard on the cache's contents, so each compiled layer compiled a second time at
        its second call (Inductor fuses the few cos/sin into the rotation's kernel instead)."""
        if torch.compiler.is_compiling():
            return self.rotation(torch.arange(seq_len, device=device))
        key = (seq_len, str(device))
        if key not in self._cache:
            self._cache = {key: self.rotation(torch.arange(seq_len, device=device))}
        return self._cache[key]

    def apply(self, x: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """x: [s, b, heads, d]; ``position_ids`` [s] (the same for every row) or [b, s] (each row
        its own: packed samples, whose positions restart; then the PyTorch definition runs: the
        fused kernels take one position table for all rows)."""
        if position_ids is None:
            cos, sin = self.cos_sin(x.shape[0], x.device)
            return self.kernel(x, cos, sin)
        if position_ids.dim() == 1:
            cos, sin = self.rotation(position_ids)
            return self.kernel(x, cos, sin)
        cos, sin = self.rotation(position_ids.t())
        return reference_ops.rotary(x, cos, sin)
