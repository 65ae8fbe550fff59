"""On the GPU machine: the CUDA builds of the fused kernels compute the PyTorch definitions.

The same checks as test_ops.py (kernel_checks.py: fresh random inputs, outputs and gradients
against fp32, < 1e-5 in fp32 and < 1e-2 in bf16/fp16) at odd shapes, at the reference model's
shapes (vectorised paths), on rows that are not 16-byte aligned (scalar paths), with enough
rows that the RMSNorm backward splits its weight gradient over many blocks, and with a norm
wide enough to need more than 48 KiB of shared memory. Then a whole transformer layer with the
kernels against the same layer in PyTorch. Skipped on machines without CUDA.
"""
from __future__ import annotations

import pytest
import torch

from hybridlm.config import FUSED_OPS, ModelConfig
from hybridlm.model.gpt import TransformerLayer
from hybridlm.ops import reference_kernels, select_kernels
from hybridlm.parallel.plan import LayerFactory, LocalOps
from hybridlm.presets import LLAMA_BLOCK_SETTINGS

from kernel_checks import DTYPES, TOLERANCE, check_rms_norm, check_rotary, check_swiglu, fresh_generator, relative_error

pytestmark = [pytest.mark.gpu, pytest.mark.ops_build,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the CUDA kernels)")]


@pytest.fixture(scope="module")
def kernels():
    return select_kernels(FUSED_OPS, require=True, device="cuda")


@pytest.fixture
def gen():
    return fresh_generator("cuda")


def test_every_op_runs_the_cuda_kernel(kernels):
    assert kernels.fused == FUSED_OPS
    assert all(path.startswith("fused (hybridlm_fused_cuda") for path in kernels.paths.values()), kernels.paths


@pytest.mark.parametrize("shape, offset", [
    pytest.param((7, 3, 33), 0, id="odd-33"),
    pytest.param((7, 3, 1000), 0, id="odd-1000"),
    pytest.param((7, 3, 1000), 1, id="unaligned-1000"),
    pytest.param((2048, 4, 2048), 0, id="reference-8192x2048"),
    pytest.param((64, 16384), 0, id="wide-16384"),
])
@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_matches_fp32_reference(kernels, gen, dtype, shape, offset):
    check_rms_norm(kernels, gen, dtype, shape, offset)


@pytest.mark.parametrize("seq, batch, heads, head_dim", [
    pytest.param(7, 2, 3, 10, id="odd"),
    pytest.param(7, 3, 5, 64, id="odd-seq-64"),
    pytest.param(2048, 4, 16, 128, id="reference"),
])
@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_matches_fp32_reference_on_a_strided_view(kernels, gen, dtype, seq, batch, heads, head_dim):
    check_rotary(kernels, gen, dtype, seq, batch, heads, head_dim)


@pytest.mark.parametrize("shape, offset", [
    pytest.param((7, 3, 33), 0, id="odd-33"),
    pytest.param((7, 3, 1000), 0, id="odd-1000"),
    pytest.param((7, 3, 1000), 1, id="unaligned-1000"),
    pytest.param((2048, 4, 5504), 0, id="reference-8192x5504"),
])
@pytest.mark.parametrize("dtype", DTYPES)
def test_swiglu_matches_fp32_reference(kernels, gen, dtype, shape, offset):
    check_swiglu(kernels, gen, dtype, shape, offset)


@pytest.mark.parametrize("dtype", DTYPES)
def test_transformer_layer_with_kernels_is_as_accurate_as_pytorch(kernels, gen, dtype):
    # The model's own wiring (q and k as views into the QKV output, [gate | up] from fc1), fwd + bwd,
    # against the same layer in fp32: in fp32 within 1e-5; in bf16/fp16 no further off than PyTorch's own path.
    cfg = ModelConfig(hidden_size=256, num_attention_heads=4, group_query_attention=True, num_query_groups=2, ffn_hidden_size=704,
                      seq_length=64, vocab_size=512, attention_backend="sdpa", **LLAMA_BLOCK_SETTINGS)
    torch.manual_seed(gen.initial_seed())
    master = TransformerLayer(cfg, LayerFactory(device="cuda", dtype=torch.float32))
    for p in master.parameters():
        torch.nn.init.normal_(p, mean=1.0 if p.dim() == 1 else 0.0, std=0.05)
    x = torch.randn(64, 3, 256, device="cuda", generator=gen)
    dy = torch.randn(64, 3, 256, device="cuda", generator=gen)

    def run(kernel_set, run_dtype):
        module = TransformerLayer(cfg, LayerFactory(ops=LocalOps(kernels=kernel_set), device="cuda", dtype=run_dtype))
        module.load_state_dict({k: v.to(run_dtype) for k, v in master.state_dict().items()})
        inp = x.to(run_dtype).clone().requires_grad_()
        out = module(inp)
        out.backward(dy.to(run_dtype))
        return {"output": out.detach(), "input grad": inp.grad, **{n: p.grad for n, p in module.named_parameters()}}

    want = run(reference_kernels(), torch.float32)
    fused = run(kernels, dtype)
    plain = run(reference_kernels(), dtype) if dtype != torch.float32 else None
    for name, target in want.items():
        err = relative_error(fused[name], target)
        bound = TOLERANCE[dtype] if plain is None else max(2 * relative_error(plain[name], target), 1e-3)
        assert err < bound, f"{name}: fused layer vs fp32 relative error {err:.2e} >= {bound:.1e} ({dtype}, seed {gen.initial_seed()})"
