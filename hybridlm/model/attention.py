"""Rotary position embeddings (the attention kernels live in ``attention_backends``)."""
from __future__ import annotations

import torch


class Rotary:
    """RoPE in the Llama / Hugging Face layout (rotate the two halves of each head).
    cos/sin are computed in fp32 and cached per (length, device); not a module buffer,
    so a bf16 cast of the model never rounds the frequencies."""

    def __init__(self, head_dim: int, base: float):
        self.head_dim, self.base = head_dim, base
        self._cache: dict = {}

    def cos_sin(self, seq_len: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        key = (seq_len, str(device))
        if key not in self._cache:
            inv_freq = 1.0 / (self.base ** (torch.arange(0, self.head_dim, 2, dtype=torch.float32, device=device) / self.head_dim))
            angles = torch.outer(torch.arange(seq_len, dtype=torch.float32, device=device), inv_freq)
            emb = torch.cat([angles, angles], dim=-1)
            self._cache = {key: (emb.cos()[:, None, None, :], emb.sin()[:, None, None, :])}  # [s, 1, 1, d]
        return self._cache[key]

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        """x: [s, b, heads, d]."""
        cos, sin = self.cos_sin(x.shape[0], x.device)
        half = x.shape[-1] // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return (x * cos.to(x.dtype)) + (rotated * sin.to(x.dtype))
