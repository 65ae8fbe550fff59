"""The numerical checks of the fused kernels, shared by the CPU (test_ops.py) and CUDA
(test_ops_gpu.py) tests: fresh random inputs, output and every input gradient against the
PyTorch definition evaluated in fp32 on the same device.

Relative error = ||got - want|| / ||want||; it must stay below 1e-5 in fp32 and 1e-2 in
bf16/fp16. Every failure message carries the generator's seed to replay it.
"""
from __future__ import annotations

import random

import pytest
import torch

from hybridlm.ops import reference

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 1e-2}
DTYPES = [pytest.param(dt, id=str(dt).split(".")[-1]) for dt in TOLERANCE]


def fresh_generator(device="cpu") -> torch.Generator:
    return torch.Generator(device=device).manual_seed(random.randrange(2**31))


def randn(gen, *shape, dtype=torch.float32):
    return torch.randn(*shape, generator=gen, device=gen.device).to(dtype)


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.double(), want.double()
    return float((got - want).norm() / want.norm().clamp_min(1e-30))


def assert_close(name, got, want, dtype, gen):
    assert got.shape == want.shape, f"{name}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    err = relative_error(got, want)
    assert err < TOLERANCE[dtype], f"{name}: relative error {err:.2e} >= {TOLERANCE[dtype]:.0e} ({dtype}, seed {gen.initial_seed()})"


def outputs_and_grads(fn, inputs, grad_out):
    """fn(*inputs) and the gradients of <fn(*inputs), grad_out> with respect to every input."""
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    out = fn(*leaves)
    grads = torch.autograd.grad(out, leaves, grad_out)
    return out.detach(), grads


def check_rms_norm(kernels, gen, dtype, shape, offset=0):
    """RMSNorm over the last dim of ``shape``; the input starts ``offset`` elements into its
    buffer (1 tests rows that are not 16-byte aligned)."""
    numel = torch.Size(shape).numel()
    buffer = randn(gen, offset + numel, dtype=dtype) * 3
    weight = (1 + 0.5 * randn(gen, shape[-1])).to(dtype)
    dy = randn(gen, *shape, dtype=dtype)

    def norm(op):
        return lambda buf, w: op(buf[offset:].view(shape), w, 1e-5)

    y, (dbuf, dw) = outputs_and_grads(norm(kernels.rms_norm), (buffer, weight), dy)
    y32, (dbuf32, dw32) = outputs_and_grads(norm(reference.rms_norm), (buffer.float(), weight.float()), dy.float())
    assert y.dtype == dtype and dbuf.dtype == dtype and dw.dtype == dtype
    for name, got, want in (("output", y, y32), ("input grad", dbuf, dbuf32), ("weight grad", dw, dw32)):
        assert_close(f"rms_norm {name}", got, want, dtype, gen)


def check_rotary(kernels, gen, dtype, seq, batch, heads, head_dim):
    """RoPE on q as the model passes it: a view into the fused QKV output (row stride > heads x d)."""
    qkv = randn(gen, seq, batch, (heads + 2) * head_dim, dtype=dtype)
    angles = randn(gen, seq, head_dim // 2) * 10
    cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()
    dy = randn(gen, seq, batch, heads, head_dim, dtype=dtype)

    def rotate(op):
        return lambda t: op(t[..., : heads * head_dim].unflatten(-1, (heads, head_dim)), cos, sin)

    y, (dqkv,) = outputs_and_grads(rotate(kernels.rotary), (qkv,), dy)
    y32, (dqkv32,) = outputs_and_grads(rotate(reference.rotary), (qkv.float(),), dy.float())
    assert_close("rotary output", y, y32, dtype, gen)
    assert_close("rotary input grad", dqkv, dqkv32, dtype, gen)


def check_swiglu(kernels, gen, dtype, shape, offset=0):
    """SwiGLU to ``shape`` from h [*shape[:-1], 2 * shape[-1]] starting ``offset`` elements into its buffer."""
    *lead, ffn = shape
    h_shape = (*lead, 2 * ffn)
    buffer = randn(gen, offset + torch.Size(h_shape).numel(), dtype=dtype) * 2
    dy = randn(gen, *shape, dtype=dtype)

    def glu(op):
        return lambda buf: op(buf[offset:].view(h_shape))

    y, (dbuf,) = outputs_and_grads(glu(kernels.swiglu), (buffer,), dy)
    y32, (dbuf32,) = outputs_and_grads(glu(reference.swiglu), (buffer.float(),), dy.float())
    assert_close("swiglu output", y, y32, dtype, gen)
    assert_close("swiglu input grad", dbuf, dbuf32, dtype, gen)
