"""--cuda-graphs: captured layers train exactly as the uncaptured ones, and what cannot be captured is refused.

The capture itself needs a CUDA GPU with Transformer Engine (its make_graphed_callables); the
refusals and the pausing of gradient hooks during capture are checked everywhere.
"""
from __future__ import annotations

import importlib.util

import pytest
import torch

from hybridlm.config import ConfigError, parse_args
from hybridlm.model.cuda_graphs import grad_hooks_paused
from oracle import TINY
from hybridlm.presets import LLAMA_BLOCK_SETTINGS

has_te = torch.cuda.is_available() and importlib.util.find_spec("transformer_engine") is not None
if has_te:
    import transformer_engine.pytorch  # noqa: F401  (before torch initialises cuDNN: see test_attention)


def needs_te(test):
    """A GPU-suite test (``pytest -m gpu``) that skips without a CUDA GPU and Transformer Engine."""
    return pytest.mark.gpu(pytest.mark.skipif(not has_te, reason="needs a CUDA GPU with Transformer Engine installed")(test))


def test_gradient_hooks_do_not_fire_while_paused_and_their_handles_still_work_after():
    # DeepSpeed keeps its gradient bookkeeping in post-accumulate-grad hooks; capture's sample
    # backward passes must not reach it (nor be recorded into the graph).
    weight = torch.nn.Parameter(torch.ones(3))
    calls = []
    handle = weight.register_post_accumulate_grad_hook(lambda p: calls.append(p.grad.clone()))
    with grad_hooks_paused([weight]):
        (2 * weight).sum().backward()
    assert calls == []
    (3 * weight).sum().backward()
    assert len(calls) == 1 and torch.equal(calls[0], torch.full((3,), 5.0))
    handle.remove()
    weight.sum().backward()
    assert len(calls) == 1, "the handle DeepSpeed holds no longer removes its hook"


def _gradient_nodes_kept_alive(flags) -> tuple[int, int, int]:
    import gc

    from torch.autograd.graph import _get_grad_fn_or_grad_acc

    from hybridlm.model.specs import transformer_layers
    from hybridlm.training.trainer import build_run, prepare_config, release_parameter_views
    run = build_run(*prepare_config(parse_args(flags)))
    params = [p for layer in transformer_layers(run.engine.module) for p in layer.parameters()]

    def kept_alive() -> int:  # a node nobody holds is made anew on each request, without the mark
        for p in params:
            _get_grad_fn_or_grad_acc(p).metadata["mark"] = True
        gc.collect()
        return sum("mark" in _get_grad_fn_or_grad_acc(p).metadata for p in params)

    before = kept_alive()
    release_parameter_views(params)
    return before, kept_alive(), len(params)


@pytest.mark.skipif(torch.cuda.is_available(), reason="forked gloo ranks cannot use CUDA; the CPU suite checks it")
def test_after_deepspeed_set_up_no_parameter_keeps_a_gradient_node_from_before_capture():
    # A node made on the default stream and kept alive makes a backward captured on another
    # stream wait on the default stream, which CUDA forbids ("operation would make the legacy
    # stream depend on a capturing blocking stream"). ZeRO-1's fp32 mapping holds such views.
    from harness import run_ranks
    from oracle import ds_config
    before, after, count = run_ranks(1, _gradient_nodes_kept_alive, TINY + ds_config("zero1") + ["--bf16"])[0]
    assert before == count, "DeepSpeed no longer pins the nodes: release_parameter_views may be unnecessary"
    assert after == 0


@pytest.mark.parametrize("flags, zero_stage, sentence", [
    (["--pipeline-model-parallel-size", "2"], 1, "--pipeline-model-parallel-size 2"),
    (["--tensor-model-parallel-size", "2"], 1, "--tensor-model-parallel-size 2"),
    (["--num-experts", "4"], 1, "--num-experts"),
    (["--recompute-granularity", "full"], 1, "--recompute-granularity full"),
    (["--hidden-dropout", "0.1"], 1, "dropout"),
    ([], 3, "ZeRO stage 3"),
    (["--torch-compile"], 1, "--torch-compile under --transformer-impl local"),
], ids=["pp", "tp", "moe", "recompute", "dropout", "zero3", "compiled_whole"])
def test_layouts_a_captured_layer_cannot_replay_are_refused_before_any_process_group(flags, zero_stage, sentence):
    cfg = parse_args(TINY + ["--cuda-graphs"] + flags)
    cfg.parallel.zero_stage = zero_stage  # what the DeepSpeed JSON would say
    with pytest.raises(ConfigError, match=f"--cuda-graphs cannot be combined with {sentence}"):
        cfg.validate(world_size=2)


@pytest.mark.skipif(has_te, reason="checks the refusal on a machine without a GPU or Transformer Engine")
def test_without_a_gpu_and_transformer_engine_the_flag_is_refused():
    from hybridlm.training.trainer import check_model_impl
    cfg = parse_args(TINY + ["--cuda-graphs"]).validate(world_size=1)
    with pytest.raises(ConfigError, match="--cuda-graphs needs a CUDA GPU and Transformer Engine"):
        check_model_impl(cfg)


def test_capture_finds_every_te_module_a_layer_calls_for_its_fp8_bookkeeping():
    # Capture keeps the FP8 scaling state of the TE modules a layer calls out of its sample passes
    # and enrols them in TE's scale updates. They sit off the module tree: in the linears, and in
    # the TP wrapper of a fused norm + MLP block, which was once missed (its scales went stale).
    from hybridlm.config import ModelConfig
    from hybridlm.model.gpt import TransformerLayer
    from hybridlm.model.transformer_engine import _TEModuleCall, te_modules_in
    from hybridlm.parallel.plan import LayerFactory, LocalOps
    made = []

    class StandIn(_TEModuleCall):
        def __init__(self, *_):
            self.module, self.phase = torch.nn.Identity(), None
            made.append(self.module)

    factory = LayerFactory(ops=LocalOps(matmul=StandIn, norm_matmul=StandIn, norm_mlp=StandIn))
    layer = TransformerLayer(ModelConfig(hidden_size=64, num_attention_heads=4, ffn_hidden_size=128, **LLAMA_BLOCK_SETTINGS), factory)
    assert layer.mlp.fused is not None, "the norm + MLP block was not fused: the test would not look inside its wrapper"
    assert {id(m) for m in te_modules_in(layer)} == {id(m) for m in made}


def _tiny_layers(fp8: bool):
    from hybridlm.config import ModelConfig
    from hybridlm.model.gpt import TransformerLayer
    from hybridlm.model.transformer_engine import MicroBatchPhase, TELocalMatmul, TELocalNormMatmul, TELocalNormMLP
    from hybridlm.parallel.plan import LayerFactory, LocalOps
    cfg = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, group_query_attention=True, num_query_groups=2,
                      ffn_hidden_size=128, seq_length=32, vocab_size=512, attention_backend="sdpa", **LLAMA_BLOCK_SETTINGS)  # cuDNN's is not captured this small
    phase = MicroBatchPhase()
    te = dict(matmul=lambda w, b: TELocalMatmul(w, b, phase),
              norm_matmul=lambda n, w, b: TELocalNormMatmul(n, w, b, phase),
              norm_mlp=lambda n, w1, w2, a: TELocalNormMLP(n, w1, w2, a, phase)) if fp8 else {}
    factory = LayerFactory(ops=LocalOps(**te), device="cuda", dtype=torch.bfloat16)
    layers = [TransformerLayer(cfg, factory, layer_number=i) for i in range(cfg.num_layers)]
    generator = torch.Generator("cuda").manual_seed(0)
    with torch.no_grad():
        for p in (p for layer in layers for p in layer.parameters() if p.dim() == 2):
            p.normal_(0, 0.05, generator=generator)
    return layers, phase


def _micro_batches(layers, inputs, phase, context):
    """Forward and backward of ``inputs`` through ``layers`` as one step's micro-batches; outputs and accumulated grads."""
    outputs = []
    for index, x in enumerate(inputs):
        phase.first = index == 0
        x = x.clone().requires_grad_()
        with context():
            y = x
            for layer in layers:
                y = layer(y)
        y.float().square().mean().backward()
        outputs.append((y.detach().clone(), x.grad.clone()))  # a replay reuses the graph's buffers
    phase.first = None
    return outputs, [p.grad.clone() for layer in layers for p in layer.parameters()]


@needs_te
# A layer compiled whole is refused with --cuda-graphs (compiled_whole above): captured, its input gradient came back
# NaN in the first rows (4 x H200, ec03df3; the case ran here with compile_layer on both sides until dd1620f).
@pytest.mark.parametrize("fp8, fused", [(False, False), (True, False), (True, True)],
                         ids=["bf16", "fp8", "fp8_gradient_accumulation_fusion"])
def test_captured_layers_accumulate_the_gradients_of_the_uncaptured_ones_over_a_step(fp8, fused):
    # Three micro-batches in one step: a replay that overwrote the previous micro-batch's
    # gradients, or fed DeepSpeed's hooks the capture's sample passes, would show here. Fused:
    # the captured TE GEMMs add into the gradient buffer (zeroed before the step, as the
    # training loop does) against autograd's sums in the uncaptured layers: bf16 rounding apart.
    import contextlib

    from transformer_engine.common import recipe as te_recipe

    from hybridlm.model.cuda_graphs import capture_layers
    from hybridlm.model.transformer_engine import fp8_context, te_modules_in
    from hybridlm.model.wgrad_fusion import MainGrads
    layers, phase = _tiny_layers(fp8)
    main_grads = MainGrads([m for layer in layers for m in te_modules_in(layer)], torch.bfloat16) if fused else None
    reference, reference_phase = _tiny_layers(fp8)  # same parameters, its own (uncaptured) TE modules
    recipe = te_recipe.DelayedScaling(fp8_format=te_recipe.Format.HYBRID) if fp8 else None
    context = (lambda: fp8_context(recipe)) if fp8 else contextlib.nullcontext
    hook_calls = []
    for p in (p for layer in layers for p in layer.parameters()):
        p.register_post_accumulate_grad_hook(lambda p: hook_calls.append(p))
    shape = (32, 2, 64)
    capture_layers(layers, shape, recipe=recipe, phase=phase)
    assert hook_calls == [], "capture's sample backward passes reached the parameters' gradient hooks"
    if main_grads is not None:
        main_grads.zero_()

    inputs = [torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=torch.Generator("cuda").manual_seed(i))
              for i in range(3)]
    captured, captured_grads = _micro_batches(layers, inputs, phase, context)
    eager, eager_grads = _micro_batches(reference, inputs, reference_phase, context)
    n_params = sum(1 for layer in layers for _ in layer.parameters())
    assert len(hook_calls) == 3 * n_params, "the hooks DeepSpeed relies on did not fire once per parameter and micro-batch"
    for index, ((y_g, dx_g), (y_e, dx_e)) in enumerate(zip(captured, eager)):
        assert _relative_error(y_g, y_e) < 1e-3, f"micro-batch {index}: output"
        assert _relative_error(dx_g, dx_e) < 1e-3, f"micro-batch {index}: input gradient"
    for index, (g, e) in enumerate(zip(captured_grads, eager_grads)):
        assert _relative_error(g, e) < (5e-3 if fused else 1e-3), f"parameter {index}: gradient accumulated over the step"
    if fp8:  # the replays' amaxes reach TE's scale update (the captured modules once stayed at scale 1)
        pairs = [(a, b) for x, y in zip(layers, reference) for a, b in zip(te_modules_in(x), te_modules_in(y))
                 if "scaling_fwd" in b.fp8_meta]
        assert pairs
        for a, b in pairs:
            for key in ("scaling_fwd", "scaling_bwd"):
                torch.testing.assert_close(a.fp8_meta[key].scale, b.fp8_meta[key].scale, rtol=0, atol=0)


def _relative_error(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@needs_te
def test_evaluation_runs_the_layers_uncaptured_and_another_shape_is_refused_in_one_sentence():
    from hybridlm.model.cuda_graphs import capture_layers
    layers, phase = _tiny_layers(fp8=False)
    capture_layers(layers, (32, 2, 64), phase=phase)
    x = torch.randn(16, 2, 64, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match=r"--cuda-graphs: the layers were captured for activations of shape \(32, 2, 64\)"):
        layers[0](x)
    layers[0].eval()
    with torch.no_grad():
        assert layers[0](x).shape == x.shape


@needs_te
def test_cudnn_attention_is_captured_only_at_the_shapes_it_was_checked_at():
    # Captured at head dim 16, sequence 32, cuDNN's attention backward read invalid memory (H200);
    # at head dim 128 it ran right. Below that, auto takes another kernel and cudnn is refused.
    from hybridlm.model.attention_backends import resolve_backend
    assert resolve_backend("auto", graphed_shape=(16, 32))[0] != "cudnn"
    with pytest.raises(ValueError, match="--attention-backend cudnn cannot be combined with --cuda-graphs at head dim 16"):
        resolve_backend("cudnn", graphed_shape=(16, 32))
    assert resolve_backend("cudnn", graphed_shape=(128, 2048))[0] == "cudnn"


@pytest.mark.parametrize("calls", [2, 1])
def test_a_layer_compiled_whole_is_compiled_for_the_capture_before_the_warmup_hooks_come(calls):
    # TE's warmup calls the layers with a forward hook on every submodule, then removes the
    # hooks and captures; compiling is not allowed inside a capture, so the capture-like call
    # (no hooks) must find a graph that the calls before the warmup compiled. One call is enough:
    # a compiled layer builds no state in its first call (RoPE's tables are computed inside the graph,
    # not cached there, which once made every layer compile again at its second call).
    from torch._dynamo.utils import counters

    from hybridlm.config import ModelConfig
    from hybridlm.model.cuda_graphs import _first_calls_outside_capture
    from hybridlm.model.execution import compile_layer
    from hybridlm.model.gpt import TransformerLayer
    from hybridlm.parallel.plan import LayerFactory
    torch._dynamo.reset()
    cfg = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64, seq_length=8,
                      vocab_size=64, attention_backend="sdpa", **LLAMA_BLOCK_SETTINGS)
    layers = [TransformerLayer(cfg, LayerFactory(), layer_number=i) for i in range(2)]
    for layer in layers:
        compile_layer(layer, backend="eager")
    samples = tuple((torch.randn(8, 2, 32, requires_grad=True),) for _ in layers)
    _first_calls_outside_capture(layers, samples, recipe=None, calls=calls)
    hooks = [m.register_forward_hook(lambda *_: None) for layer in layers for m in layer.modules()]
    for layer, (x,) in zip(layers, samples):  # TE's warmup
        layer(x)
    for hook in hooks:
        hook.remove()
    compiled = counters["stats"]["unique_graphs"]
    for layer, (x,) in zip(layers, samples):  # as the capture calls them
        layer(x)
    assert counters["stats"]["unique_graphs"] == compiled, "the capture-like call compiled a new graph"
