"""On the GPU machine: context parallelism's GPU kernels and the ring's block merge, then CP on
two GPUs against one.

One GPU: each log-sum-exp block kernel (torch's flash, cuDNN, flash-attn) against the plain
PyTorch definition in bf16, and the ring algorithm simulated over N virtual ranks in one process
(each rank's blocks in the ring's order, merged by log-sum-exp, gradients summed as dK/dV would
travel home) against full causal attention: the GPU kernels and the merge are checked without a
second GPU. Inputs include the ones that break kernels (large logits, peaked attention, tied keys, long sequences),
and the bound is a small multiple of bf16 rounding itself. Two GPUs (NCCL): on the same weights and batch, CP=2's
loss and gradient are as close to the fp32 ones as one GPU's bf16 ones (p2p and a2a), and over 60 steps the curves
stay together by benchmarks/curves.py's rule.

Skipped on CPU machines (CI); run there with `pytest -m gpu tests/test_context_parallel_gpu.py`.
"""
from __future__ import annotations

import pytest
import torch

from oracle import TINY
from test_gpu import _launch

pytestmark = pytest.mark.gpu
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
two_gpus = pytest.mark.gpus(2)  # skipped on fewer (conftest); in the GPU suite, a lane of two
BACKENDS = ["sdpa", "cudnn", "flash"]


def _kernel(backend: str):
    from hybridlm.model.attention_backends import make_block_attention, resolve_backend
    try:
        resolve_backend(backend)
    except ValueError as e:
        pytest.skip(str(e))
    return make_block_attention(backend)


# ---------------------------------------------------------------- inputs a benign N(0, 1) draw never produces

INPUTS = ("normal", "large_logits", "peaked", "repeated_keys")


def _qkv(kind: str, rows: int, cols: int, heads: int, groups: int, causal: bool, dim: int = 128, batch: int = 2,
         dtype=torch.bfloat16):
    """q, dout [rows, b, heads, d] and k, v [cols, b, groups, d] of one kind:
    normal         N(0, 1) (the scores have a standard deviation of about 1);
    large_logits   q and k scaled by 4: scores of standard deviation 16, most rows nearly one-hot;
    peaked         each query is 6 x one visible key plus noise: one score (about 6 sqrt(d) = 68) dwarfs the rest;
    repeated_keys  8 distinct keys repeated along the sequence: many exactly tied scores, distinct values."""
    generator = torch.Generator(device="cuda").manual_seed(rows + 7 * cols + heads + groups + INPUTS.index(kind))

    def draw(n, h):
        return torch.randn(n, batch, h, dim, device="cuda", generator=generator)

    q, k, v, dout = draw(rows, heads), draw(cols, groups), draw(cols, groups), draw(rows, heads)
    if kind == "large_logits":
        q, k = 4 * q, 4 * k
    elif kind == "peaked":
        offset = cols - rows if causal else 0  # causal blocks end aligned: query i sees keys up to i + offset
        visible = torch.arange(rows, device="cuda") + offset if causal else torch.full((rows,), cols - 1, device="cuda")
        target = (torch.rand(rows, device="cuda", generator=generator) * (visible + 1)).long()
        chosen = k[target].repeat_interleave(heads // groups, dim=2)  # [rows, b, heads, d]: each head's own K/V head
        q = 6 * chosen + 0.5 * q
    elif kind == "repeated_keys":
        k = k[:8].repeat(cols // 8 + 1, 1, 1, 1)[:cols]
    return tuple(t.to(dtype).contiguous() for t in (q, k, v, dout))


# ---------------------------------------------------------------- the bound: a small multiple of bf16 rounding itself

UNIT_ROUNDOFF = 2.0 ** -8  # bf16's: 8 significant bits


def _allowed(want: torch.Tensor, magnitude: torch.Tensor) -> float:
    """The error no kernel with a bf16 result can be held below: the exact answer merely rounded to bf16, or, where
    the answer is a cancellation of much larger terms (the gradient of a peaked row is about 0 while dP and D are not),
    a fraction of the unit roundoff of those terms (``magnitude``: the same sums over absolute values)."""
    rounded = float((want.to(torch.bfloat16).double() - want).norm())
    return max(rounded, UNIT_ROUNDOFF / 8 * float(magnitude.norm()))


# A kernel rounds its fp32 result to bf16 once (ratio ~1 on benign inputs); inside, flash-style kernels also round the
# probabilities (dv = P^T dout) and dS to bf16 for the tensor cores. Measured on an H100 (torch 2.11; torch's flash
# and cuDNN kernels, alone and merged over 2 and 4 simulated ranks, every input kind): at most 1.20 for the output,
# 0.91 for dq, 0.71 for dk, 1.57 for dv, and a log-sum-exp within 3.4e-5. The bounds leave room for other kernels
# and cards, and still fail a wrong block, mask, scale or merge by orders of magnitude.
FACTOR = {"output": 2.0, "dq": 2.0, "dk": 2.0, "dv": 2.5}
LSE_ATOL = 2e-4  # fp32 log-sum-exp of fp32 scores (up to ~70 here); the definition's is fp64


def _check(what: str, name: str, got: torch.Tensor, want: torch.Tensor, magnitude: torch.Tensor) -> None:
    err, allowed = float((got.double() - want).norm()), _allowed(want, magnitude)
    relative = err / float(want.norm().clamp_min(1e-300))
    print(f"{what} {name}: error {err / allowed:.2f} x the bf16 floor (relative error {relative:.1e})")
    assert err <= FACTOR[name] * allowed, (f"{what} {name}: error {err:.2e} (relative {relative:.1e}) is {err / allowed:.1f} x "
                                           f"the bf16 floor {allowed:.2e}; bound {FACTOR[name]}")


def _magnitudes(dout, q, k, v, out, lse, causal) -> dict:
    """The attention sums with every term made positive, in fp64: out = P|V|; dq, dk from P (|dP| + |D|) with |K|, |Q|;
    dv = P^T |dout|. Each bounds how much rounding the matching result can carry."""
    from hybridlm.model.attention_backends import MathBlockAttention, _fold_heads
    dout, q, k, v, out, lse = (t.double() for t in (dout, q, k, v, out, lse))
    definition, repeat, scale = MathBlockAttention(), q.shape[2] // k.shape[2], q.shape[-1] ** -0.5
    probs = torch.exp(definition._scores(q, k, causal) - lse.unsqueeze(-1))  # [b, h, sq, sk]
    k_, v_ = (t.repeat_interleave(repeat, dim=2).abs() for t in (k, v))
    dprobs = torch.einsum("qbhd,kbhd->bhqk", dout, v.repeat_interleave(repeat, dim=2)).abs()
    row_dot = (dout * out).sum(-1).permute(1, 2, 0).abs().unsqueeze(-1)
    terms = probs * (dprobs + row_dot) * scale
    return {"output": torch.einsum("bhqk,kbhd->qbhd", probs, v_),
            "dq": torch.einsum("bhqk,kbhd->qbhd", terms, k_),
            "dk": _fold_heads(torch.einsum("bhqk,qbhd->kbhd", terms, q.abs()), k.shape[2]),
            "dv": _fold_heads(torch.einsum("bhqk,qbhd->kbhd", probs, dout.abs()), k.shape[2])}


def _exact_forward(q, k, v, causal):
    """The definition in fp64 on the same (bf16) inputs: output and log-sum-exp."""
    from hybridlm.model.attention_backends import MathBlockAttention
    return MathBlockAttention().forward(q.double(), k.double(), v.double(), causal)


def _exact_backward(dout, q, k, v, out, lse, causal):
    """dq, dk, dv of the definition in fp64 given the backward kernel's own inputs. Like flash attention's, the
    backward takes the (bf16) output and reads D = rowsum(dout * out) from it, so its gradient is that of the
    rounded output: against a peaked row the exact gradient (about 0) would make any kernel look infinitely wrong."""
    from hybridlm.model.attention_backends import MathBlockAttention
    return MathBlockAttention().backward(*(t.double() for t in (dout, q, k, v, out, lse)), causal)


@cuda
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", INPUTS)
@pytest.mark.parametrize("heads, groups", [(8, 8), (8, 2)], ids=["mha", "gqa"])
@pytest.mark.parametrize("causal, rows, cols", [(True, 512, 512), (False, 256, 512), (False, 512, 256)],
                         ids=["causal_square", "half_queries", "half_keys"])
def test_block_kernel_returns_the_definitions_output_lse_and_gradients(backend, kind, heads, groups, causal, rows, cols):
    kernel = _kernel(backend)
    q, k, v, dout = _qkv(kind, rows, cols, heads, groups, causal)
    want_out, want_lse = _exact_forward(q, k, v, causal)
    out, lse = kernel.forward(q, k, v, causal)
    assert out.shape == q.shape and out.dtype == q.dtype and lse.shape == (q.shape[1], heads, rows)
    what = f"{backend} {kind}"
    # the backward takes the merged output and log-sum-exp, here the exact ones as the ring would hand them
    merged = (want_out.to(q.dtype), want_lse.float())
    magnitude = _magnitudes(dout, q, k, v, *merged, causal)
    _check(what, "output", out, want_out, magnitude["output"])
    lse_err = float((lse.double() - want_lse).abs().max())
    print(f"{what} lse: max abs error {lse_err:.2e}")
    assert lse_err <= LSE_ATOL, f"{what}: log-sum-exp off by {lse_err:.2e}"
    got = kernel.backward(dout, q, k, v, *merged, causal)
    for name, g, w, like in zip(("dq", "dk", "dv"), got, _exact_backward(dout, q, k, v, *merged, causal), (q, k, v)):
        assert g.shape == like.shape, f"{backend} {name} shape {tuple(g.shape)}"
        _check(what, name, g, w, magnitude[name])


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
@pytest.mark.parametrize("kind, seq", [("normal", 2048), ("large_logits", 2048), ("peaked", 2048), ("repeated_keys", 2048),
                                       ("normal", 8192)], ids=["normal", "large_logits", "peaked", "repeated_keys", "long"])
@pytest.mark.parametrize("size", [2, 4])
@pytest.mark.parametrize("heads, groups", [(8, 8), (8, 2)], ids=["mha", "gqa"])
def test_ring_simulated_over_n_ranks_on_one_gpu_equals_full_causal_attention(backend, kind, seq, size, heads, groups):
    from hybridlm.parallel.context import load_balanced_positions
    kernel = _kernel(backend)
    batch = 1 if seq > 4096 else 2
    q, k, v, dout = _qkv(kind, seq, seq, heads, groups, causal=True, batch=batch)
    want_out, want_lse = _exact_forward(q, k, v, True)
    outs, grads = _simulated_ring(q, k, v, dout, size, kernel)
    what = f"{backend} {kind} seq {seq} CP={size}"
    natural = torch.argsort(torch.cat([load_balanced_positions(seq, r, size, device="cuda") for r in range(size)]))
    out = torch.cat(outs).index_select(0, natural)  # the ranks' rows back in sequence order
    magnitude = _magnitudes(dout, q, k, v, out, want_lse, True)
    _check(what, "output", out, want_out, magnitude["output"])
    for i, (name, want) in enumerate(zip(("dq", "dk", "dv"), _exact_backward(dout, q, k, v, out, want_lse, True))):
        _check(what, name, torch.cat([grads[r][i] for r in range(size)]).index_select(0, natural), want, magnitude[name])


@two_gpus
def test_cp2_on_the_same_weights_and_batch_gives_one_gpus_loss_and_gradient_to_bf16_precision(tmp_path):
    # The sharp instrument: no updates in between to amplify rounding. Each layout's gradient is compared with the
    # fp32 one-GPU gradient of the same weights and batch; CP's must be as close to it as one GPU's own bf16 one
    # (on an H100: 5.0e-3 for CP=2 p2p and a2a, 8.9e-3 for one GPU, from the weights of iteration 15).
    from benchmarks.same_weights import REFERENCE, SAVER, SETUPS, run
    setup = SETUPS["cp"]
    variants = {name: setup.variants[name] for name in (SAVER, REFERENCE, "CP2 p2p bf16", "CP2 a2a bf16")}
    probes = run(str(tmp_path), at=[3], steps=0, setup=setup, variants=variants)["probes"][3]
    exact, one = probes[REFERENCE], probes[SAVER]
    for comm in ("p2p", "a2a"):
        cp = probes[f"CP2 {comm} bf16"]
        assert abs(cp["loss"] - exact["loss"]) <= max(2 * abs(one["loss"] - exact["loss"]), 1e-3 * exact["loss"]), \
            f"CP=2 {comm}: loss {cp['loss']} on the same weights vs fp32 {exact['loss']} (1 GPU bf16 {one['loss']})"
        assert cp["grad_err_vs_fp32"]["all"] <= 1.5 * one["grad_err_vs_fp32"]["all"], \
            f"CP=2 {comm}: gradient {cp['grad_err_vs_fp32']['all']:.2e} from fp32, one GPU in bf16 {one['grad_err_vs_fp32']['all']:.2e}"
        assert abs(cp["clip_norm"] - cp["full_grad_norm"]) <= 1e-3 * cp["full_grad_norm"], \
            f"CP=2 {comm}: clipped with norm {cp['clip_norm']} while its gradient's norm is {cp['full_grad_norm']}"


@two_gpus
@pytest.mark.parametrize("comm", ["p2p", "a2a"])
def test_cp2_on_two_gpus_tracks_one_gpu_over_60_bf16_steps_by_the_curves_rule(tmp_path, comm):
    # At TINY's constant 1e-3 without warm-up this model spikes at step 16 in every layout, one GPU in fp32 included,
    # and the spike's height is rounding amplified: from the same weights of iteration 14 one GPU and CP=2 p2p/a2a
    # reach 4.450, 4.449 and 4.449 at step 16, while their own 15-step trajectories reach 4.45, 6.07 and 11.02
    # (benchmarks/same_weights.py). So: benchmarks/curves.py's schedule (3e-4, warm-up) and rule (means of 10 steps
    # within 2%).
    from hybridlm.training.curves import compare, load_losses
    flags = ["--deepspeed_config", "ds_configs/zero1.json", *TINY, "--bf16", "--lr", "3e-4", "--min-lr", "3e-5",
             "--lr-warmup-iters", "10", "--train-iters", "60", "--log-interval", "1", "--seq-length", "1024",
             "--hidden-size", "256", "--num-attention-heads", "4", "--ffn-hidden-size", "512"]
    _launch(1, flags, tmp_path / "one.jsonl")
    _launch(2, flags + ["--context-parallel-size", "2", "--cp-comm-type", comm], tmp_path / "two.jsonl", log_says="CP=2")
    result = compare(load_losses(tmp_path / "one.jsonl"), load_losses(tmp_path / "two.jsonl"), window=10, skip=0)
    assert result.max_gap <= 0.02, f"CP=2 {comm}: windowed loss gap {100 * result.max_gap:.2f}% at steps {result.worst_window}"
