"""Rotary position embeddings (the attention kernels live in ``attention_backends``)."""
from __future__ import annotations

import torch

from ..ops import reference as reference_ops


class Rotary:
    """RoPE in the Llama / Hugging Face layout (rotate the two halves of each head).
    cos/sin are computed in fp32 and cached per (length, device); not a module buffer,
    so a bf16 cast of the model never rounds the frequencies. ``kernel`` applies them
    (hybridlm.ops: a fused kernel, or the PyTorch definition). ``positions(length, device)``
    gives the global positions of the rows a rank holds (context parallelism: slices of the
    sequence), or None for 0..length-1."""

    def __init__(self, head_dim: int, base: float, kernel=reference_ops.rotary, positions=None):
        self.head_dim, self.base, self.kernel = head_dim, base, kernel
        self.positions = positions
        self._cache: dict = {}

    def cos_sin(self, seq_len: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        key = (seq_len, str(device))
        if key not in self._cache:
            inv_freq = 1.0 / (self.base ** (torch.arange(0, self.head_dim, 2, dtype=torch.float32, device=device) / self.head_dim))
            positions = self.positions(seq_len, device) if self.positions is not None else None
            if positions is None:
                positions = torch.arange(seq_len, device=device)
            angles = torch.outer(positions.to(torch.float32), inv_freq)
            emb = torch.cat([angles, angles], dim=-1)
            self._cache = {key: (emb.cos(), emb.sin())}  # [s, d]
        return self._cache[key]

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        """x: [s, b, heads, d]."""
        cos, sin = self.cos_sin(x.shape[0], x.device)
        return self.kernel(x, cos, sin)
