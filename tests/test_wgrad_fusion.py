"""--gradient-accumulation-fusion: weight gradients summed inside the GEMMs train exactly as autograd's sums.

On CPU the GEMMs are stand-ins that keep Transformer Engine's contract for fused accumulation
(with ``fuse_wgrad_accumulation`` set, the weight gradient goes into ``weight.main_grad``,
overwritten at a step's first micro-batch and added to after, and autograd receives a shared
placeholder tensor); their placeholder is NaN, so adding it anywhere shows. DeepSpeed and
torch.distributed are the real ones. With TE itself the same is checked on a GPU
(tests/test_transformer_engine.py and tests/test_gpu.py).
"""
from __future__ import annotations

import contextlib
import importlib.util
import json
import os
from functools import partial

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from harness import run_ranks
from hybridlm.config import ConfigError, parse_args
from hybridlm.model.transformer_engine import MicroBatchPhase, _TEModuleCall
from hybridlm.model.wgrad_fusion import MainGrads
from oracle import ROOT, TINY, ds_config

has_te = torch.cuda.is_available() and importlib.util.find_spec("transformer_engine") is not None
if has_te:
    import transformer_engine.pytorch  # noqa: F401  (before torch initialises cuDNN: see test_attention)


def needs_te(test):
    """A GPU-suite test (``pytest -m gpu``) that skips without a CUDA GPU and Transformer Engine."""
    return pytest.mark.gpu(pytest.mark.skipif(not has_te, reason="needs a CUDA GPU with Transformer Engine installed")(test))


cpu_only = pytest.mark.skipif(torch.cuda.is_available(), reason="forked gloo ranks cannot use CUDA; the CPU suite checks it")

_PLACEHOLDERS: dict = {}


class _GemmKeepingTEContract(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, module, first):
        ctx.save_for_backward(x, weight)
        ctx.module, ctx.first = module, first
        return F.linear(x, weight)

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        wgrad = dy.flatten(0, -2).t() @ x.flatten(0, -2)
        if not ctx.module.fuse_wgrad_accumulation:
            return dy @ weight, wgrad, None, None
        if ctx.first:
            weight.main_grad.copy_(wgrad)
        else:
            weight.main_grad.add_(wgrad)
        key = (weight.shape, weight.dtype)
        placeholder = _PLACEHOLDERS.setdefault(key, torch.full(weight.shape, float("nan"), dtype=weight.dtype))
        return dy @ weight, placeholder.detach() if hasattr(weight, "grad_added_to_main_grad") else None, None, None


class _StandInTE(nn.Module):
    """``captured``: always accumulate, as the replay of a layer captured outside any step does."""

    def __init__(self, captured: bool):
        super().__init__()
        self.fuse_wgrad_accumulation, self.captured = False, captured

    def gemm(self, x, weight, is_first_microbatch):
        # TE overwrites main_grad only when told this is a step's first micro-batch (None: accumulate)
        return _GemmKeepingTEContract.apply(x, weight, self, is_first_microbatch is True and not self.captured)


class _StandInLinear(_StandInTE):
    def __init__(self, weight, captured):
        super().__init__(captured)
        self.weight = weight

    def forward(self, x, is_first_microbatch=None):
        return self.gemm(x, self.weight, is_first_microbatch)


class StandInMatmul(_TEModuleCall):
    """TE's Linear (TELocalMatmul) on our weight; no bias in TINY."""

    def __init__(self, weight, bias, phase, captured=False):
        assert bias is None
        self.module, self.phase = _StandInLinear(weight, captured), phase


class _StandInNormMLP(_StandInTE):
    def __init__(self, norm, fc1_weight, fc2_weight, captured):
        super().__init__(captured)
        self.norm, self.fc1_weight, self.fc2_weight = norm, fc1_weight, fc2_weight

    def forward(self, x, is_first_microbatch=None):
        gate, up = self.gemm(self.norm(x), self.fc1_weight, is_first_microbatch).chunk(2, dim=-1)
        return self.gemm(F.silu(gate) * up, self.fc2_weight, is_first_microbatch)


class StandInNormMLP(_TEModuleCall):
    """TE's LayerNormMLP (TELocalNormMLP): its weights are named fc1_weight and fc2_weight."""

    def __init__(self, norm, fc1_weight, fc2_weight, activation, phase, captured=False):
        assert activation == "swiglu"
        self.module, self.phase = _StandInNormMLP(norm, fc1_weight, fc2_weight, captured), phase


def test_after_every_backward_grad_holds_the_running_sum_and_the_placeholder_is_never_added():
    phase = MicroBatchPhase()
    weight = nn.Parameter(torch.randn(3, 4))
    linear = StandInMatmul(weight, None, phase)
    fused = MainGrads([linear.module], torch.float32)
    seen_by_later_hooks = []  # DeepSpeed's hooks come after the fusion's and read .grad
    weight.register_post_accumulate_grad_hook(lambda p: seen_by_later_hooks.append(p.grad.clone()))
    inputs = [torch.randn(5, 4, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    fused.zero_()
    running = torch.zeros(3, 4)
    for index, x in enumerate(inputs):
        phase.first = index == 0
        linear(x).square().sum().backward()
        running += 2 * (x @ weight.detach().t()).t() @ x
        torch.testing.assert_close(weight.grad, running)
        torch.testing.assert_close(seen_by_later_hooks[-1], running)
    assert weight.grad.data_ptr() == fused.buffer.data_ptr(), ".grad is a copy, not the buffer"
    assert len(seen_by_later_hooks) == 3


def _train(flags: list[str], fused: bool, captured: bool = False, steps: int = 3) -> dict:
    """The run build_run makes, with stand-ins where TE's modules would be."""
    import deepspeed

    from hybridlm.model.specs import build_model
    from hybridlm.model.transformer_engine import te_modules_in
    from hybridlm.model.weights import init_parameters
    from hybridlm.parallel.plan import LayerFactory, LocalOps, ModelGroups
    from hybridlm.parallel.random import seed_everything
    from hybridlm.parallel.state import ParallelState
    from hybridlm.training.distributed import init_distributed
    from hybridlm.training.optim import WarmupDecayLR, build_optimizer
    from hybridlm.training.ds_config import model_dtype
    from hybridlm.training.trainer import Run, build_datasets, data_iterator, prepare_config, train_step
    cfg, ds = prepare_config(parse_args(flags))
    init_distributed(1.0)
    p, t = cfg.parallel, cfg.train
    ps = ParallelState(tp=p.tensor_model_parallel_size, pp=1, dp=p.data_parallel_size, ep=1)
    seed_everything(t.seed, ps.tp.rank, ps.pp.rank)
    phase = MicroBatchPhase()
    ops = LocalOps(matmul=partial(StandInMatmul, phase=phase, captured=captured),
                   norm_mlp=partial(StandInNormMLP, phase=phase, captured=captured))
    model = build_model(cfg.model, LayerFactory(ModelGroups(tp=ps.tp), sequence_parallel=p.sequence_parallel, ops=ops))
    init_parameters(model, t.seed, ps.tp, ps.ep)
    main_grads = MainGrads(te_modules_in(model), model_dtype(cfg)) if fused else None
    optimizer, _ = build_optimizer(model, t, ps, zero_stage=p.zero_stage, offloading=False, on_gpu=False)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds, mpu=ps,
                                      lr_scheduler=lambda opt: WarmupDecayLR.from_config(opt, t))
    run = Run(cfg, ps, engine, False, *build_datasets(cfg), phase=phase, main_grads=main_grads)
    batches = data_iterator(run)
    losses = [train_step(run, batches).item() for _ in range(steps)]
    return {"losses": losses, "params": {n: q.detach().float().clone() for n, q in model.named_parameters()},
            "fused": 0 if main_grads is None else len(main_grads.weights)}


def _overlapping_zero1(tmp_path) -> list[str]:
    ds = json.load(open(os.path.join(ROOT, "ds_configs", "zero1.json")))
    ds["zero_optimization"]["overlap_comm"] = True  # ZeRO-1 then reduces inside its gradient hooks
    path = tmp_path / "zero1_overlap.json"
    path.write_text(json.dumps(ds))
    return ["--deepspeed_config", str(path)]


@cpu_only
@pytest.mark.parametrize("zero, extra, ranks, captured", [
    ("zero0", [], 2, False), ("zero1", ["--bf16"], 1, False), ("zero1", [], 2, True), ("zero1_overlap", ["--bf16"], 2, False),
    ("zero1", ["--tensor-model-parallel-size", "2", "--sequence-parallel"], 2, False),
], ids=["zero0_fp32_dp2", "zero1_bf16", "zero1_fp32_dp2_always_accumulating", "zero1_overlap_comm_bf16_dp2", "zero1_fp32_tp2_sp"])
def test_fused_accumulation_trains_as_autograd_accumulation_through_deepspeed(tmp_path, zero, extra, ranks, captured):
    # TINY: 4 micro-batches per step on one rank (2 on each of two); three steps. The sums are
    # the same additions in the same order, so losses and weights agree exactly. Always
    # accumulating (as captured layers do), the buffer must be zeroed between steps.
    config = _overlapping_zero1(tmp_path) if zero == "zero1_overlap" else ds_config(zero)
    flags = TINY + config + extra
    separate = run_ranks(ranks, _train, flags, False)
    fused = run_ranks(ranks, _train, flags, True, captured)
    assert fused[0]["fused"] == 4 * 4  # per layer: QKV, attention output, the MLP block's fc1 and fc2
    for rank, (want, got) in enumerate(zip(separate, fused)):
        assert got["losses"] == want["losses"], f"rank {rank}: {got['losses']} vs {want['losses']}"
        assert want["losses"][-1] < want["losses"][0]
        for name, value in want["params"].items():
            assert torch.equal(got["params"][name], value), f"rank {rank}: {name} differs after {len(want['losses'])} steps"


@pytest.mark.parametrize("flags, zero_stage, sentence", [
    ([], 1, "--transformer-impl local"),
    (["--transformer-impl", "transformer_engine"], 2, "ZeRO stage 2"),
    (["--transformer-impl", "transformer_engine"], 3, "ZeRO stage 3"),
    (["--transformer-impl", "transformer_engine", "--pipeline-model-parallel-size", "2"], 1, "--pipeline-model-parallel-size 2"),
], ids=["local", "zero2", "zero3", "pp"])
def test_layouts_that_accumulate_gradients_another_way_are_refused_before_any_process_group(flags, zero_stage, sentence):
    cfg = parse_args(TINY + ["--gradient-accumulation-fusion"] + flags)
    cfg.parallel.zero_stage = zero_stage  # what the DeepSpeed JSON would say
    with pytest.raises(ConfigError, match=f"--gradient-accumulation-fusion cannot be combined with {sentence}"):
        cfg.validate(world_size=2)


@pytest.mark.parametrize("json_part, offloaded, sentence", [
    ({"data_types": {"grad_accum_dtype": "fp32"}}, [], "\"data_types.grad_accum_dtype\": 'fp32' in"),
    ({}, ["optimizer"], "offload_optimizer"),
], ids=["fp32_accumulation", "offload"])
def test_deepspeed_settings_that_take_the_gradients_away_are_refused(json_part, offloaded, sentence):
    from hybridlm.training.ds_config import check_gradient_accumulation_fusion
    cfg = parse_args(TINY + ["--bf16", "--transformer-impl", "transformer_engine", "--gradient-accumulation-fusion"])
    with pytest.raises(ConfigError, match=f"--gradient-accumulation-fusion cannot be combined with {sentence}"):
        check_gradient_accumulation_fusion(json_part, cfg, offloaded)
    check_gradient_accumulation_fusion({"data_types": {"grad_accum_dtype": "bf16"}}, cfg, [])  # the model's own: fine


def _te_adapter(kind: str, phase):
    """A TE adapter on bf16 weights drawn from a fixed seed (two calls: two equal copies), and its parameters."""
    from hybridlm.model.gpt import RMSNorm
    from hybridlm.model.transformer_engine import TELocalMatmul, TELocalNormMatmul, TELocalNormMLP
    generator = torch.Generator("cuda").manual_seed(0)

    def weight(*shape):
        return nn.Parameter((0.05 * torch.randn(*shape, device="cuda", generator=generator)).bfloat16())
    norm = RMSNorm(256, 1e-5, device="cuda", dtype=torch.bfloat16)
    if kind == "linear":
        w = weight(384, 256)
        return TELocalMatmul(w, None, phase), [w]
    if kind == "norm_linear":
        w = weight(384, 256)
        return TELocalNormMatmul(norm, w, None, phase), [w, norm.weight]
    fc1, fc2 = weight(768, 256), weight(256, 384)
    return TELocalNormMLP(norm, fc1, fc2, "swiglu", phase), [fc1, fc2, norm.weight]


@needs_te
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize("kind", ["linear", "norm_linear", "norm_mlp"])
def test_te_adapters_sum_weight_gradients_in_their_gemms_as_autograd_sums_them(kind, fp8):
    # Three micro-batches of one step; after each, the fused copy's .grad (TE's GEMM adding into
    # the buffer) and the separate copy's (autograd adding) agree to bf16 rounding. A norm's
    # weight is summed by autograd on both sides.
    from transformer_engine.common import recipe

    from hybridlm.model.transformer_engine import fp8_context
    runs = []
    for fused in (True, False):
        phase = MicroBatchPhase()
        adapter, params = _te_adapter(kind, phase)
        runs.append((adapter, params, phase))
        if fused:
            main_grads = MainGrads([adapter.module], torch.bfloat16)
            main_grads.zero_()
    context = (lambda: fp8_context(recipe.DelayedScaling(fp8_format=recipe.Format.HYBRID))) if fp8 else contextlib.nullcontext
    for index in range(3):
        x = torch.randn(64, 2, 256, device="cuda", generator=torch.Generator("cuda").manual_seed(index + 1)).bfloat16()
        for adapter, _, phase in runs:
            phase.first = index == 0
            with context():
                y = adapter(x)
            y.float().square().mean().backward()
        for position, (fused, separate) in enumerate(zip(runs[0][1], runs[1][1])):
            error = ((fused.grad.float() - separate.grad.float()).norm() / separate.grad.float().norm()).item()
            assert error < 1e-2, f"micro-batch {index}, parameter {position}: relative error {error:.3g}"
    for weight in main_grads.weights:
        offset = weight.grad.data_ptr() - main_grads.buffer.data_ptr()
        assert 0 <= offset < main_grads.buffer.numel() * main_grads.buffer.element_size(), ".grad is not the buffer"
