"""The pure-PyTorch definitions of the fused ops: what runs when no kernel does, and what the
kernels are tested against. They are the model's definitions, moved here unchanged.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Normalise in fp32, cast back to the input dtype, then scale (the Llama / Hugging Face definition)."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE in the half-rotation layout. x [s, b, heads, d]; cos, sin [s, d] fp32, or [s, b, d]
    when each row has its own positions (packed samples)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    at = (slice(None), None, None) if cos.dim() == 2 else (slice(None), slice(None), None)
    cos, sin = cos[at].to(x.dtype), sin[at].to(x.dtype)
    return (x * cos) + (rotated * sin)


def swiglu(h: torch.Tensor) -> torch.Tensor:
    """h [..., 2f] = [gate | up] -> silu(gate) * up [..., f]."""
    gate, up = h.chunk(2, dim=-1)
    return F.silu(gate) * up
