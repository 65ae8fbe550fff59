"""Attention kernels behind one signature, and rotary position embeddings.

A backend takes q [b, heads, s, d] and k, v [b, groups, s, d] (grouped-query attention:
heads is a multiple of groups) and returns [b, heads, s, d], causal. torch SDPA is always
available; flash-attn and Transformer Engine register here when installed.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F


def sdpa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float = 0.0) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True,
                                          enable_gqa=q.shape[1] != k.shape[1])


BACKENDS: dict[str, Callable] = {"sdpa": sdpa_attention}


def get_backend(name: str) -> Callable:
    if name == "auto":
        name = "sdpa"
    if name not in BACKENDS:
        raise ValueError(f"--attention-backend {name} is not available here (have: {', '.join(sorted(BACKENDS))}).")
    return BACKENDS[name]


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
