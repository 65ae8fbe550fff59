"""Transformer Engine adapters: what they compute, and when they may reuse FP8 weights.

The training loop tells TE which micro-batch of an optimizer step is running (CPU-checked
here); on a GPU with TE installed, the adapters are checked against plain PyTorch on the
same parameters, and the FP8 weight cache against a fresh cast.
"""
from __future__ import annotations

import importlib.util

import pytest
import torch
import torch.nn.functional as F

from harness import run_ranks
from oracle import TINY, ds_config

has_te = torch.cuda.is_available() and importlib.util.find_spec("transformer_engine") is not None
if has_te:
    import transformer_engine.pytorch  # noqa: F401  (before torch initialises cuDNN: see test_attention)


def needs_te(test):
    """A GPU-suite test (``pytest -m gpu``) that skips without a CUDA GPU and Transformer Engine."""
    return pytest.mark.gpu(pytest.mark.skipif(not has_te, reason="needs a CUDA GPU with Transformer Engine installed")(test))


def _phases_seen_by_the_model(flags):
    from hybridlm.config import parse_args
    from hybridlm.training.trainer import build_run, data_iterator, prepare_config, train_step
    cfg, ds = prepare_config(parse_args(flags))
    run = build_run(cfg, ds)
    seen = []
    run.engine.module.register_forward_pre_hook(lambda *_: seen.append(run.phase.first))
    batches = data_iterator(run)
    for _ in range(2):
        train_step(run, batches)
    return seen, run.phase.first


@pytest.mark.skipif(torch.cuda.is_available(), reason="forked gloo ranks cannot use CUDA; the CPU suite checks the loop")
def test_each_optimizer_step_marks_its_first_micro_batch_and_clears_the_mark_after():
    # TINY: global batch 8 of micro-batches of 2 -> 4 micro-batches per step. Weights change at the
    # step, so only the first micro-batch may (re)make the FP8 weight copies; after the step the
    # mark is cleared so evaluation or generation never reads a cache.
    seen, after = run_ranks(1, _phases_seen_by_the_model, TINY + ds_config("zero1"))[0]
    assert seen == [True, False, False, False] * 2
    assert after is None


def _bf16(*shape, scale=1.0, seed=0):
    generator = torch.Generator(device="cuda").manual_seed(seed)
    return torch.nn.Parameter((scale * torch.randn(*shape, device="cuda", generator=generator)).bfloat16())


@needs_te
def test_te_linears_reuse_fp8_weights_within_a_step_and_recast_at_its_first_micro_batch():
    from transformer_engine.common import recipe

    from hybridlm.model.transformer_engine import MicroBatchPhase, TELocalMatmul, fp8_context
    phase = MicroBatchPhase()
    weight = _bf16(128, 64, scale=0.05)
    linear = TELocalMatmul(weight, None, phase)
    x = _bf16(256, 64, seed=1).detach()
    with fp8_context(recipe.DelayedScaling(fp8_format=recipe.Format.HYBRID)):
        phase.first = True
        first = linear(x)
        with torch.no_grad():
            weight.mul_(2)  # stands for an optimizer step that TE is not told about
        phase.first = False
        later = linear(x)
        phase.first = None
        fresh = linear(x)
        phase.first = True
        next_step = linear(x)
    assert torch.equal(later, first), "a later micro-batch re-cast the weights instead of using the step's FP8 copy"
    assert torch.allclose(fresh.float(), 2 * first.float(), rtol=0.1, atol=0.05), "without the mark the weights were not cast afresh"
    assert torch.allclose(next_step.float(), fresh.float(), rtol=0.1, atol=0.05), "a step's first micro-batch did not re-cast"


@needs_te
@pytest.mark.parametrize("normalization", ["RMSNorm", "LayerNorm"])
@pytest.mark.parametrize("activation", ["swiglu", "gelu_tanh"])
def test_te_norm_mlp_block_computes_the_pytorch_block_on_our_parameters(normalization, activation):
    from hybridlm.model.gpt import RMSNorm
    from hybridlm.model.transformer_engine import TELocalNormMLP
    hidden, ffn = 256, 384
    if normalization == "RMSNorm":
        norm = RMSNorm(hidden, 1e-5, device="cuda", dtype=torch.bfloat16)
    else:
        norm = torch.nn.LayerNorm(hidden, eps=1e-5, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    fc1 = _bf16(ffn * (2 if activation == "swiglu" else 1), hidden, scale=0.05, seed=2)
    fc2 = _bf16(hidden, ffn, scale=0.05, seed=3)
    x = _bf16(64, 2, hidden, seed=4).detach().requires_grad_()
    params = [x, fc1, fc2, *norm.parameters()]

    def reference(x):
        h = F.linear(norm(x).float(), fc1.float())
        if activation == "swiglu":
            gate, up = h.chunk(2, dim=-1)
            h = F.silu(gate) * up
        else:
            h = F.gelu(h, approximate="tanh")
        return F.linear(h, fc2.float())

    want = reference(x)
    want_grads = torch.autograd.grad(want.sum(), params)
    block = TELocalNormMLP(norm, fc1, fc2, activation)
    got = block(x)
    got_grads = torch.autograd.grad(got.float().sum(), params)
    assert all(any(p is q for q in params) for p in block.module.parameters()), "TE holds weights of its own"
    assert torch.allclose(got.float(), want, rtol=2e-2, atol=2e-2)
    for name, g, w in zip(["x", "fc1", "fc2", "norm weight", "norm bias"], got_grads, want_grads):
        error = (g.float() - w).norm() / w.norm()
        assert error < 2e-2, f"{name}: relative gradient error {error:.3g}"


def _experts_reference(x, w1, w2, counts):
    """The experts in fp32, one matmul per expert: SwiGLU between w1 ([gate; up]) and w2."""
    out = []
    for rows, a, b in zip(x.float().split(counts), w1.float(), w2.float()):
        gate, up = (rows @ a.t()).chunk(2, dim=-1)
        out.append((F.silu(gate) * up) @ b.t())
    return torch.cat(out)


def _swiglu(h):
    gate, up = h.chunk(2, dim=-1)
    return F.silu(gate) * up


@needs_te
def test_te_grouped_experts_compute_the_experts_in_fp8_on_our_stacked_parameters():
    # Rows per expert that FP8's GEMMs cannot take as they come (not multiples of 16, one expert
    # with none): the adapter pads each group and cuts the padding off again, forward and backward.
    from transformer_engine.common import recipe

    from hybridlm.model.transformer_engine import TEGroupedExperts, fp8_context
    experts, hidden, ffn, counts = 4, 256, 384, [37, 0, 100, 119]
    w1 = _bf16(experts, 2 * ffn, hidden, scale=0.05, seed=2)
    w2 = _bf16(experts, hidden, ffn, scale=0.05, seed=3)
    x = _bf16(sum(counts), hidden, seed=4).detach().requires_grad_()
    want = _experts_reference(x, w1, w2, counts)
    want_grads = torch.autograd.grad(want.square().sum(), [x, w1, w2])
    block = TEGroupedExperts(w1, w2, _swiglu)
    with fp8_context(recipe.Float8CurrentScaling(fp8_format=recipe.Format.HYBRID)):
        got = block(x, torch.tensor(counts, device="cuda"))
    got_grads = torch.autograd.grad(got.float().square().sum(), [x, w1, w2])
    assert block.fc1.module.fp8 and block.fc2.module.fp8, "the grouped GEMMs did not run in FP8"
    assert not list(block.fc1.module.parameters()) and not list(block.fc2.module.parameters()), "TE holds weights of its own"
    assert got.shape == want.shape
    error = (got.float() - want).norm() / want.norm()
    assert error < 0.08, f"output: relative error {error:.3g} to fp32"
    for name, g, w in zip(["x", "w1", "w2"], got_grads, want_grads):
        error = (g.float() - w).norm() / w.norm()
        assert error < 0.15, f"{name}: relative gradient error {error:.3g} to fp32"
    assert got_grads[1][1].abs().sum() == 0, "an expert with no rows got a gradient (the padding leaked into it)"


@needs_te
def test_te_grouped_experts_reuse_fp8_weights_within_a_step():
    from transformer_engine.common import recipe

    from hybridlm.model.transformer_engine import MicroBatchPhase, TEGroupedExperts, fp8_context
    phase, counts = MicroBatchPhase(), torch.tensor([48, 16], device="cuda")
    w1, w2 = _bf16(2, 256, 128, scale=0.05, seed=2), _bf16(2, 128, 128, scale=0.05, seed=3)
    block = TEGroupedExperts(w1, w2, _swiglu, phase)
    x = _bf16(64, 128, seed=4).detach()
    with fp8_context(recipe.DelayedScaling(fp8_format=recipe.Format.HYBRID)):
        phase.first = True
        first = block(x, counts)
        with torch.no_grad():
            w2.mul_(2)  # stands for an optimizer step that TE is not told about
        phase.first = False
        later = block(x, counts)
        phase.first = None
        fresh = block(x, counts)
    assert torch.equal(later, first), "a later micro-batch re-cast the experts' weights instead of using the step's FP8 copy"
    assert torch.allclose(fresh.float(), 2 * first.float(), rtol=0.15, atol=0.05), "without the mark the weights were not cast afresh"
