"""The output head fused into its cross-entropy (hybridlm/parallel/fused_head.py) computes what the head and
the loss compute apart: the same per-token losses and the same gradients of the hidden states and of the
weight, over chunks of rows, with vocabulary padding, ignored targets and a sampling temperature, at any TP;
and GRPO's training step takes that path without changing its result."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from harness import run_ranks
from hybridlm.parallel import tensor_parallel
from hybridlm.parallel.fused_head import HeadLogits, fused_head_cross_entropy
from hybridlm.parallel.state import SINGLE
from hybridlm.parallel.tensor_parallel import IGNORE_INDEX

ROWS, WIDTH, VOCAB, PADDED = 9, 16, 37, 48  # 37 real words, padded to 48 rows of the head


def _case(seed: int, dtype=torch.float64):
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(ROWS, 2, WIDTH, generator=generator, dtype=dtype)
    weight = torch.randn(PADDED, WIDTH, generator=generator, dtype=dtype)
    target = torch.randint(0, VOCAB, (ROWS, 2), generator=generator)
    target[0, 1] = target[5, 0] = IGNORE_INDEX
    return hidden, weight, target


def _weights(loss):
    """A different upstream gradient for every token (a loss weighs its tokens)."""
    return torch.linspace(0.5, 2.0, loss.numel(), dtype=loss.dtype, device=loss.device).view(loss.shape)


def _unfused(hidden, weight, target, temperature=1.0):
    """The definition: the head's logits over the real words, divided by the temperature, then cross-entropy."""
    hidden, weight = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    logits = F.linear(hidden, weight)[..., :VOCAB] / temperature
    wide = logits.reshape(-1, VOCAB).to(torch.promote_types(logits.dtype, torch.float32))
    loss = F.cross_entropy(wide, target.reshape(-1), reduction="none",
                           ignore_index=IGNORE_INDEX).view(target.shape)
    (loss * _weights(loss)).sum().backward()
    return loss.detach(), hidden.grad, weight.grad


def _fused(hidden, weight, target, temperature=1.0, tp=SINGLE, vocab=VOCAB):
    hidden, weight = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    loss = fused_head_cross_entropy(HeadLogits(hidden, weight) / temperature, target, tp, vocab)
    (loss * _weights(loss)).sum().backward()
    return loss.detach(), hidden.grad, weight.grad


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("chunk_rows", [1, 4, 100])
def test_fused_head_gives_the_losses_and_gradients_of_the_head_and_loss_apart(monkeypatch, temperature, chunk_rows):
    monkeypatch.setattr(tensor_parallel, "_CHUNK_ELEMENTS", chunk_rows * VOCAB)  # one row a chunk .. all rows in one
    hidden, weight, target = _case(1)
    want, got = _unfused(hidden, weight, target, temperature), _fused(hidden, weight, target, temperature)
    for name, a, b in zip(("loss", "hidden grad", "weight grad"), got, want):
        assert torch.allclose(a, b, rtol=1e-10, atol=1e-12), name
    assert got[0][0, 1] == 0 and got[0][5, 0] == 0, "an ignored target has loss 0"
    assert not got[2][VOCAB:].any(), "the padding rows of the head get no gradient"


def test_fused_head_in_bf16_is_as_close_to_fp32_as_the_unfused_head():
    hidden, weight, target = _case(2, torch.float32)
    exact = _unfused(hidden.double(), weight.double(), target)
    half = [x.bfloat16() for x in (hidden, weight)]
    for name, fused, apart, truth in zip(("loss", "hidden grad", "weight grad"), _fused(*half, target), _unfused(*half, target), exact):
        fused_error = (fused.double() - truth).abs().max()
        apart_error = (apart.double() - truth).abs().max()
        assert fused_error <= 1.5 * apart_error + 1e-6, f"{name}: fused {fused_error:.2e}, apart {apart_error:.2e}"


def _tp_ranks(seed: int, temperature: float):
    import torch.distributed as dist

    from hybridlm.parallel.state import ParallelState
    from hybridlm.training.distributed import init_distributed
    init_distributed(1)
    ps = ParallelState(tp=dist.get_world_size())
    hidden, weight, target = _case(seed)
    share = PADDED // ps.tp.size
    mine = weight[ps.tp.rank * share:(ps.tp.rank + 1) * share]
    loss, grad_hidden, grad_weight = _fused(hidden, mine, target, temperature, ps.tp)
    return loss, grad_hidden, grad_weight  # the hidden states' gradient is this rank's part (the head's crossing sums it)


@pytest.mark.parametrize("tp", [2, 4])  # at TP=4 the last rank holds only padding (rows 36-47: one real word)
def test_fused_head_under_tensor_parallelism_equals_one_process(tp):
    seed = int(torch.randint(0, 2**31, ()).item())
    results = run_ranks(tp, _tp_ranks, seed, 0.7)
    want = _unfused(*_case(seed), temperature=0.7)
    assert all(torch.allclose(r[0], want[0], rtol=1e-10, atol=1e-12) for r in results), "every TP rank has the whole loss"
    assert torch.allclose(sum(r[1] for r in results), want[1], rtol=1e-10, atol=1e-12)
    assert torch.allclose(torch.cat([r[2] for r in results]), want[2], rtol=1e-10, atol=1e-12)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_a_gpu_the_fused_head_never_holds_the_logits_and_matches_the_unfused_head():
    """GRPO's micro-batch on Qwen2-0.5B's head: 4,096 completion tokens, 151,936 words, width 896, bf16."""
    generator = torch.Generator(device="cuda").manual_seed(0)
    hidden = torch.randn(4096, 896, device="cuda", generator=generator).bfloat16()
    weight = (0.02 * torch.randn(151936, 896, device="cuda", generator=generator)).bfloat16()
    target = torch.randint(0, 151646, (4096,), device="cuda", generator=generator)
    logits_bytes = 4096 * 151936 * 2

    def peak_above_inputs(run):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        result = run()
        torch.cuda.synchronize()
        return result, torch.cuda.max_memory_allocated() - base

    apart, apart_peak = peak_above_inputs(lambda: _unfused_on(hidden, weight, target))
    fused, fused_peak = peak_above_inputs(lambda: _fused(hidden, weight, target, 0.7, vocab=151646))
    assert fused_peak < apart_peak - logits_bytes, f"fused {fused_peak / 2**30:.2f} GiB, apart {apart_peak / 2**30:.2f} GiB"
    for name, a, b in zip(("loss", "hidden grad", "weight grad"), fused, apart):
        scale = b.float().abs().max()
        assert (a.float() - b.float()).abs().max() <= 2e-2 * scale, name


def _unfused_on(hidden, weight, target):
    """The unfused path as the model runs it: the head's bf16 logits, then the vocab-parallel cross-entropy."""
    from hybridlm.parallel.tensor_parallel import vocab_parallel_cross_entropy
    hidden, weight = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(F.linear(hidden, weight) / 0.7, target, SINGLE, 151646)
    (loss * _weights(loss)).sum().backward()
    return loss.detach(), hidden.grad, weight.grad
