"""On the GPU machine: context parallelism's GPU kernels and the ring's block merge, then CP on
two GPUs against one.

One GPU: each log-sum-exp block kernel (torch's flash, cuDNN, flash-attn) against the plain
PyTorch definition in bf16, and the ring algorithm simulated over N virtual ranks in one process
(each rank's blocks in the ring's order, merged by log-sum-exp, gradients summed as dK/dV would
travel home) against full causal attention: the GPU kernels and the merge are checked without a
second GPU. Two GPUs (NCCL): CP=2 tracks one GPU over 20 bf16 steps, p2p and a2a.

Skipped on CPU machines (CI); run there with `pytest -m gpu tests/test_context_parallel_gpu.py`.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from oracle import TINY
from test_gpu import _launch

pytestmark = pytest.mark.gpu
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs (NCCL)")
BACKENDS = ["sdpa", "cudnn", "flash"]


def _kernel(backend: str):
    from hybridlm.model.attention_backends import make_block_attention, resolve_backend
    try:
        resolve_backend(backend)
    except ValueError as e:
        pytest.skip(str(e))
    return make_block_attention(backend)


def _qkv(seq: int, heads: int, groups: int, dim: int = 128, batch: int = 2, dtype=torch.bfloat16):
    generator = torch.Generator(device="cuda").manual_seed(seq + heads + groups)
    q, k, v, dout = (torch.randn(seq, batch, n, dim, device="cuda", dtype=dtype, generator=generator)
                     for n in (heads, groups, groups, heads))
    return q, k, v, dout


def _close(got, want, what: str, tol: float = 3e-2):
    err = float((got.float() - want.float()).norm() / want.float().norm())
    assert err < tol, f"{what}: relative error {err:.2e}"


@cuda
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("heads, groups", [(8, 8), (8, 2)], ids=["mha", "gqa"])
@pytest.mark.parametrize("causal, rows, cols", [(True, 512, 512), (False, 256, 512), (False, 512, 256)],
                         ids=["causal_square", "half_queries", "half_keys"])
def test_block_kernel_returns_the_definitions_output_lse_and_gradients(backend, heads, groups, causal, rows, cols):
    from hybridlm.model.attention_backends import MathBlockAttention
    kernel, definition = _kernel(backend), MathBlockAttention()
    q, _, _, dout = _qkv(rows, heads, groups)
    _, k, v, _ = _qkv(cols, heads, groups)
    out, lse = kernel.forward(q, k, v, causal)
    want_out, want_lse = definition.forward(q, k, v, causal)
    assert out.shape == q.shape and out.dtype == q.dtype and lse.shape == (q.shape[1], heads, rows)
    _close(out, want_out, f"{backend} output")
    torch.testing.assert_close(lse.float(), want_lse, rtol=1e-2, atol=1e-2)
    got = kernel.backward(dout, q, k, v, want_out, want_lse, causal)
    want = definition.backward(dout, q, k, v, want_out, want_lse, causal)
    for name, g, w, like in zip(("dq", "dk", "dv"), got, want, (q, k, v)):
        assert g.shape == like.shape, f"{backend} {name} shape {tuple(g.shape)}"
        _close(g, w, f"{backend} {name}")


def _simulated_ring(q, k, v, dout, size: int, kernel):
    """The ring of ``size`` ranks in one process: each rank's blocks in the ring's order and
    merge, and each block's dK/dV added to the K/V's owner (what travels home)."""
    from hybridlm.parallel.context import MergedBlocks, ring_block, slice_for_rank
    local = [[slice_for_rank(t, 0, r, size) for t in (q, k, v, dout)] for r in range(size)]
    half = q.shape[0] // size // 2
    outs, grads = [], [[torch.zeros_like(t, dtype=torch.float32) for t in local[r][:3]] for r in range(size)]
    for rank in range(size):
        merged = MergedBlocks()
        for step in range(size):
            q_rows, k_rows, causal = ring_block(step, rank, size, half)
            source = local[(rank - step) % size]
            out, lse = kernel.forward(local[rank][0][q_rows], source[1][k_rows], source[2][k_rows], causal)
            merged.add(q_rows, out, lse, 2 * half)
        out, lse = merged.out.to(q.dtype), merged.lse
        outs.append(out)
        for step in range(size):
            q_rows, k_rows, causal = ring_block(step, rank, size, half)
            owner = (rank - step) % size
            dq, dk, dv = kernel.backward(local[rank][3][q_rows], local[rank][0][q_rows], local[owner][1][k_rows],
                                         local[owner][2][k_rows], out[q_rows], lse[..., q_rows], causal)
            grads[rank][0][q_rows] += dq
            grads[owner][1][k_rows] += dk
            grads[owner][2][k_rows] += dv
    return outs, grads


@cuda
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("size", [2, 4])
@pytest.mark.parametrize("heads, groups", [(8, 8), (8, 2)], ids=["mha", "gqa"])
def test_ring_simulated_over_n_ranks_on_one_gpu_equals_full_causal_attention(backend, size, heads, groups):
    from hybridlm.parallel.context import slice_for_rank
    kernel = _kernel(backend)
    q, k, v, dout = _qkv(2048, heads, groups)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    want = F.scaled_dot_product_attention(*(t.permute(1, 2, 0, 3) for t in leaves), is_causal=True,
                                          enable_gqa=heads != groups).permute(2, 0, 1, 3)
    (want.float() * dout.float()).sum().backward()
    outs, grads = _simulated_ring(q, k, v, dout, size, kernel)
    for rank in range(size):
        _close(outs[rank], slice_for_rank(want.detach(), 0, rank, size), f"{backend} rank {rank} output")
        for name, got, leaf in zip(("dq", "dk", "dv"), grads[rank], leaves):
            _close(got, slice_for_rank(leaf.grad, 0, rank, size), f"{backend} rank {rank} {name}")


@two_gpus
@pytest.mark.parametrize("comm", ["p2p", "a2a"])
def test_cp2_on_two_gpus_tracks_one_gpu_over_20_bf16_steps(tmp_path, comm):
    # The same global batch: 2 GPUs each hold half of every 1024-token sample.
    flags = ["--deepspeed_config", "ds_configs/zero1.json", *TINY, "--bf16", "--lr", "1e-3", "--train-iters", "20",
             "--log-interval", "1", "--seq-length", "1024", "--hidden-size", "256", "--num-attention-heads", "4",
             "--ffn-hidden-size", "512"]
    one = _launch(1, flags, tmp_path / "one.jsonl")
    two = _launch(2, flags + ["--context-parallel-size", "2", "--cp-comm-type", comm], tmp_path / "two.jsonl", log_says="CP=2")
    assert len(one) == len(two) == 20
    for step, (a, b) in enumerate(zip(one, two), start=1):
        assert abs(a - b) <= 2e-2 * abs(a), f"step {step}: CP=2 loss {b} vs 1 GPU {a}"
