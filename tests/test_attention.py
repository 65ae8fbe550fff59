"""Every attention backend computes the same causal attention as an fp32 reference.

The reference is written out (scores, causal mask, softmax, weighted sum) in fp64, so it
shares no code with any backend. CPU runs check torch SDPA and the refusals; on a GPU each
installed backend (sdpa, cudnn, flash, te) is checked in bf16, forward and gradients.
"""
from __future__ import annotations

import importlib.util
import math

import pytest
import torch

from hybridlm.config import ConfigError, parse_args
from hybridlm.model.attention_backends import BACKENDS, block_kernel_name, make_attention_core, make_block_attention, resolve_backend
from hybridlm.training.trainer import check_model_impl, prepare_config

cuda = torch.cuda.is_available()
if cuda and importlib.util.find_spec("transformer_engine") is not None:
    # TE loads its own cuDNN libraries, which fails once torch has initialised cuDNN (the
    # cudnn cases run first); loading TE first lets both work in one process.
    import transformer_engine.pytorch  # noqa: F401


def reference_attention(q, k, v):
    """q [s, b, h, d], k/v [s, b, g, d] -> [s, b, h, d], causal, in fp64."""
    s, _, h, d = q.shape
    repeat = h // k.shape[2]
    q, k, v = (t.double().permute(1, 2, 0, 3) for t in (q, k, v))
    k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
    scores = q @ k.transpose(-1, -2) / math.sqrt(d)
    mask = torch.ones(s, s, dtype=torch.bool, device=q.device).triu(1)
    probs = scores.masked_fill(mask, float("-inf")).softmax(-1)
    return (probs @ v).permute(2, 0, 1, 3)


def relative_error(a, b, floor: float):
    """Norm-wise relative error, the reference's norm floored at ``floor``: dq of a single token is
    exactly zero (softmax over one key), so there the error is rounding noise against the scale of
    the incoming gradient, not against zero."""
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(floor)).item()


def check_against_reference(core, *, s, b, heads, groups, d, dtype, device, tol):
    seed = torch.seed()  # fresh inputs every run; the seed is in the failure message
    q = torch.randn(s, b, heads, d, dtype=dtype, device=device, requires_grad=True)
    k = torch.randn(s, b, groups, d, dtype=dtype, device=device, requires_grad=True)
    v = torch.randn(s, b, groups, d, dtype=dtype, device=device, requires_grad=True)
    grad_out = torch.randn(s, b, heads, d, dtype=dtype, device=device)
    out = core(q, k, v, 0.0)
    out.backward(grad_out)
    got = [out.detach(), q.grad, k.grad, v.grad]
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    want = reference_attention(*leaves)
    want.backward(grad_out.double())
    for name, a, w in zip(("output", "dq", "dk", "dv"), got, [want.detach()] + [t.grad for t in leaves]):
        assert a.shape == w.shape, f"{name}: shape {tuple(a.shape)} vs {tuple(w.shape)}"
        err = relative_error(a, w, floor=0.1 * grad_out.double().norm().item())
        assert err < tol, f"{name}: relative error {err:.2e} >= {tol} (seed {seed}, shape s{s} b{b} h{heads} g{groups} d{d})"


@pytest.mark.parametrize("s, b, heads, groups, d", [(16, 2, 4, 4, 8), (37, 3, 6, 2, 16), (1, 1, 2, 1, 4)],
                         ids=["mha", "gqa_odd_length", "one_token"])
def test_sdpa_matches_the_fp32_reference(s, b, heads, groups, d):
    core = make_attention_core("sdpa", heads=heads, groups=groups, head_dim=d, dropout=0.0)
    check_against_reference(core, s=s, b=b, heads=heads, groups=groups, d=d, dtype=torch.float32, device="cpu", tol=1e-5)


@pytest.mark.skipif(cuda, reason="checks what a machine without a GPU does")
def test_auto_picks_sdpa_without_a_gpu():
    assert resolve_backend("auto")[0] == "sdpa"


@pytest.mark.skipif(cuda, reason="checks what a machine without a GPU does")
@pytest.mark.parametrize("backend", ["cudnn", "flash", "te"])
def test_a_gpu_backend_on_a_cpu_machine_is_one_sentence_before_any_process_group(backend):
    with pytest.raises(ConfigError, match=f"--attention-backend {backend} is not usable here"):
        prepare_config(parse_args(["--attention-backend", backend]), world_size=1)


@pytest.mark.skipif(cuda, reason="checks what a machine without a GPU does")
def test_transformer_engine_without_a_gpu_is_refused_up_front():
    with pytest.raises(ConfigError, match="--transformer-impl transformer_engine needs"):
        prepare_config(parse_args(["--transformer-impl", "transformer_engine"]), world_size=1)


def test_fp8_needs_transformer_engine_and_bf16():
    # Without --transformer-impl, FP8 picks Transformer Engine (Megatron's default implementation).
    with pytest.raises(ConfigError, match="--fp8-format hybrid needs --transformer-impl transformer_engine"):
        prepare_config(parse_args(["--fp8-format", "hybrid", "--bf16", "--transformer-impl", "local"]), world_size=1)
    with pytest.raises(ConfigError, match="needs --bf16"):
        prepare_config(parse_args(["--fp8-format", "e4m3"]), world_size=1)


# ---------------------------------------------------------------- GPU


def _usable(backend: str) -> bool:
    try:
        resolve_backend(backend)
        return True
    except ValueError:
        return False


@pytest.mark.gpu
@pytest.mark.skipif(not cuda, reason="needs a CUDA GPU")
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("s, b, heads, groups, d", [(256, 2, 8, 8, 64), (333, 1, 8, 2, 128)], ids=["mha", "gqa_odd_length"])
def test_gpu_backend_matches_the_reference_in_bf16(backend, s, b, heads, groups, d):
    if not _usable(backend):
        pytest.skip(f"{backend} is not installed on this machine")
    core = make_attention_core(backend, heads=heads, groups=groups, head_dim=d, dropout=0.0)
    check_against_reference(core, s=s, b=b, heads=heads, groups=groups, d=d, dtype=torch.bfloat16, device="cuda", tol=1e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not cuda, reason="needs a CUDA GPU")
def test_auto_on_a_gpu_prefers_flash_then_cudnn():
    backend, why = resolve_backend("auto")
    if _usable("flash"):
        assert backend == "flash", why
    elif torch.cuda.get_device_capability() >= (9, 0):
        assert backend == "cudnn", why


def test_an_fp32_run_resolves_auto_to_sdpa_and_says_why():
    assert resolve_backend("auto", half_precision=False) == ("sdpa", "auto: an fp32 run (torch SDPA's fp32 kernels)")


@pytest.mark.gpu
@pytest.mark.skipif(not cuda, reason="needs a CUDA GPU (without one the backend is refused as not usable)")
@pytest.mark.parametrize("backend", ["cudnn", "flash"])
def test_an_fp32_run_asking_for_a_half_precision_kernel_is_refused_in_one_sentence(backend):
    if not _usable(backend):
        pytest.skip(f"{backend} is not installed on this machine")
    with pytest.raises(ConfigError, match=f"--attention-backend {backend} runs in bf16 or fp16 only and this run is fp32"):
        prepare_config(parse_args(["--attention-backend", backend]), world_size=1)
    cfg, _ = prepare_config(parse_args(["--attention-backend", backend, "--bf16"]), world_size=1)
    assert cfg.model.half_precision


def test_the_cp_block_kernel_is_the_definition_on_cpus_and_in_fp32_and_the_backends_own_in_bf16_on_gpus():
    assert block_kernel_name("cudnn", half_precision=True, on_gpu=True) == "cudnn"
    assert block_kernel_name("sdpa", half_precision=True, on_gpu=True) == "sdpa"
    assert block_kernel_name("cudnn", half_precision=False, on_gpu=True) == "math"
    assert block_kernel_name("sdpa", half_precision=True, on_gpu=False) == "math"


@pytest.mark.skipif(cuda, reason="checks what a machine without a GPU does")
def test_a_cp_run_resolves_its_block_kernel_once_and_its_log_line_names_it():
    cfg, _ = prepare_config(parse_args(["--context-parallel-size", "2", "--position-embedding-type", "rope", "--bf16",
                                        "--attention-dropout", "0"]), world_size=2)
    assert cfg.model.attention_block_kernel == "math"
    assert "CP p2p blocks on the fp32 PyTorch definition's (CPU or fp32) kernel" in check_model_impl(cfg)


@pytest.mark.gpu
@pytest.mark.skipif(not cuda, reason="needs a CUDA GPU")
@pytest.mark.parametrize("kernel", ["cudnn core", "cudnn block", "sdpa block", "flash core", "flash block"])
def test_a_half_precision_kernel_handed_fp32_raises_instead_of_running_the_definition(kernel):
    # before: cuDNN's and flash-attn's kernels quietly ran SDPA or the fp32 definition on fp32 inputs
    backend, part = kernel.split()
    if not _usable(backend):
        pytest.skip(f"{backend} is not installed on this machine")
    q = torch.randn(64, 1, 2, 32, device="cuda")
    with pytest.raises(RuntimeError, match="runs on CUDA tensors in bf16 or fp16 and was given torch.float32"):
        if part == "core":
            make_attention_core(backend, heads=2, groups=2, head_dim=32, dropout=0.0)(q, q, q)
        else:
            make_block_attention(backend).forward(q, q, q, True)


# ---------------------------------------------------------------- packed samples (--packing)

def packed_positions(lengths_per_row: list[list[int]], device="cpu") -> torch.Tensor:
    """Position ids [b, s] of rows holding samples of the given lengths (each restarting at 0)."""
    return torch.stack([torch.cat([torch.arange(n) for n in row]) for row in lengths_per_row]).to(device)


def check_packed_against_reference(core, lengths_per_row, *, heads, groups, d, dtype, device, tol, starts_from_host=False):
    """Each sample of a packed row must get exactly its own causal attention: the reference runs
    every sample alone. ``starts_from_host``: the ids reach the device as the data path sends them,
    with their sample starts found on the host."""
    if starts_from_host:
        from hybridlm.data.samples import tensor_to_device
        from hybridlm.model.attention_backends import sample_starts
        positions = packed_positions(lengths_per_row)
        sample_starts(positions)
        positions = tensor_to_device(positions, device)
    else:
        positions = packed_positions(lengths_per_row, device)
    b, s = positions.shape
    q = torch.randn(s, b, heads, d, dtype=dtype, device=device, requires_grad=True)
    k = torch.randn(s, b, groups, d, dtype=dtype, device=device, requires_grad=True)
    v = torch.randn(s, b, groups, d, dtype=dtype, device=device, requires_grad=True)
    grad_out = torch.randn(s, b, heads, d, dtype=dtype, device=device)
    out = core(q, k, v, 0.0, positions)
    out.backward(grad_out)
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    pieces = []
    for row, lengths in enumerate(lengths_per_row):
        start, outs = 0, []
        for n in lengths:
            outs.append(reference_attention(*(t[start:start + n, row:row + 1] for t in leaves)))
            start += n
        pieces.append(torch.cat(outs))
    want = torch.cat(pieces, dim=1)
    want.backward(grad_out.double())
    for name, a, w in zip(("output", "dq", "dk", "dv"), [out.detach(), q.grad, k.grad, v.grad], [want.detach()] + [t.grad for t in leaves]):
        err = relative_error(a, w, floor=0.1 * grad_out.double().norm().item())
        assert err < tol, f"{name}: relative error {err:.2e} >= {tol} with packed rows {lengths_per_row}"


ROWS = [[5, 1, 9, 3], [18]]  # a one-token sample, a row with one sample


def test_sdpa_keeps_packed_samples_apart():
    core = make_attention_core("sdpa", heads=4, groups=2, head_dim=8, dropout=0.0)
    check_packed_against_reference(core, ROWS, heads=4, groups=2, d=8, dtype=torch.float32, device="cpu", tol=1e-5)


def test_packing_refuses_backends_that_cannot_isolate_samples_and_auto_picks_one_that_can():
    for backend in ("cudnn", "te"):
        with pytest.raises(ValueError, match=f"--attention-backend {backend} cannot keep packed samples apart"):
            resolve_backend(backend, packing=True)
    assert resolve_backend("auto", packing=True)[0] in ("flash", "sdpa")


@pytest.mark.gpu
@pytest.mark.skipif(not cuda, reason="needs a CUDA GPU")
@pytest.mark.parametrize("backend", ["sdpa", "flash"])
def test_gpu_packed_attention_keeps_samples_apart_in_bf16(backend):
    try:
        resolve_backend(backend, packing=True)
    except ValueError as e:
        pytest.skip(str(e))
    core = make_attention_core(backend, heads=8, groups=2, head_dim=128, dropout=0.0)
    rows = [[100, 1, 200, 56], [300, 57]]
    check_packed_against_reference(core, rows, heads=8, groups=2, d=128, dtype=torch.bfloat16, device="cuda", tol=1e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not cuda, reason="needs a CUDA GPU")
@pytest.mark.parametrize("groups", [8, 2, 1])
def test_gpu_sdpa_packs_through_torchs_variable_length_kernel_never_a_mask(groups, monkeypatch):
    # The block-diagonal mask costs a whole causal row per packed row; on a GPU in bf16 the sdpa
    # core must take torch's variable-length kernel instead (the mask builder is made to fail),
    # with grouped KV heads as they are, and still keep every sample apart.
    import hybridlm.model.attention_backends as backends
    if not backends.torch_varlen_available():
        pytest.skip("torch.nn.attention.varlen is not in this torch (2.10 or newer has it)")

    def no_mask(positions):
        raise AssertionError("the packed bf16 path built a block-diagonal mask")
    monkeypatch.setattr(backends, "packed_causal_mask", no_mask)
    core = make_attention_core("sdpa", heads=8, groups=groups, head_dim=128, dropout=0.0)
    rows = [[700, 1, 300, 23], [1024]]
    check_packed_against_reference(core, rows, heads=8, groups=groups, d=128, dtype=torch.bfloat16, device="cuda", tol=1e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not cuda, reason="needs a CUDA GPU")
def test_gpu_packed_fp32_and_dropout_fall_back_to_the_mask(monkeypatch):
    # The variable-length kernel is half precision without dropout; other inputs must still be
    # computed (by SDPA with the mask), not refused or silently unmasked.
    import hybridlm.model.attention_backends as backends
    used = []
    real = backends.packed_causal_mask
    monkeypatch.setattr(backends, "packed_causal_mask", lambda positions: used.append(1) or real(positions))
    core = make_attention_core("sdpa", heads=4, groups=2, head_dim=32, dropout=0.0)
    check_packed_against_reference(core, [[40, 1, 23], [64]], heads=4, groups=2, d=32, dtype=torch.float32, device="cuda", tol=1e-4)
    assert used, "fp32 packed rows must take the masked SDPA path"
    used.clear()
    positions = packed_positions([[40, 1, 23], [64]], "cuda")
    q = torch.randn(64, 2, 4, 32, dtype=torch.bfloat16, device="cuda")
    kv = torch.randn(64, 2, 2, 32, dtype=torch.bfloat16, device="cuda")
    assert torch.isfinite(core(q, kv, kv, 0.1, positions)).all()
    assert used, "bf16 packed rows with attention dropout must take the masked SDPA path (the varlen kernel has none)"


@pytest.mark.gpu
@pytest.mark.skipif(not cuda, reason="needs a CUDA GPU")
def test_gpu_packed_attention_compiles_to_one_graph_when_the_ids_bring_their_sample_starts():
    # With the starts found on the host, nothing in the packed path reads the device back, so a
    # compiled layer need not break its graph around attention (fullgraph=True fails on any break);
    # a new number of samples per row is not a new graph either.
    import hybridlm.model.attention_backends as backends
    if not backends.torch_varlen_available():
        pytest.skip("torch.nn.attention.varlen is not in this torch (2.10 or newer has it)")
    torch._dynamo.reset()
    compiled = torch.compile(make_attention_core("sdpa", heads=8, groups=2, head_dim=128, dropout=0.0), fullgraph=True)
    for rows in ([[700, 1, 300, 23], [1024]], [[100, 200, 300, 424], [512, 512]]):
        check_packed_against_reference(compiled, rows, heads=8, groups=2, d=128, dtype=torch.bfloat16, device="cuda",
                                       tol=1e-2, starts_from_host=True)
