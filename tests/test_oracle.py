"""Every parallel layout computes the single-process function.

Each test trains the same tiny model from the same seed for 3 optimizer steps on N gloo
ranks and compares, against one fp32 process: the loss of every step, the global gradient
norm of every step, and every full gradient of step 1 (relative error < 1e-5).
"""
from __future__ import annotations

import pytest
import torch

from harness import run_ranks
from oracle import TINY, assert_matches, ds_config, train_and_probe

UNTIED = ["--untie-embeddings-and-output-weights"]
GPT2 = ["--normalization", "LayerNorm", "--position-embedding-type", "learned_absolute", "--no-swiglu", "--add-bias-linear",
        "--num-query-groups", "4"]

_references: dict = {}


def reference(variant: tuple[str, ...] = ()) -> dict:
    """The single-process run of TINY + variant (cached per variant for the session)."""
    if variant not in _references:
        _references[variant] = run_ranks(1, train_and_probe, TINY + list(variant) + ds_config("zero0"))[0]
    return _references[variant]


def parallel(world: int, layout: list[str], zero: str, variant: tuple[str, ...] = (), timeout: float = 180.0) -> dict:
    results = run_ranks(world, train_and_probe, TINY + list(variant) + layout + ds_config(zero), timeout=timeout)
    for other in results[1:]:
        assert other["losses"] == results[0]["losses"], "ranks disagree on the loss"
    return results[0]


TP2 = ["--tensor-model-parallel-size", "2"]
PP2 = ["--pipeline-model-parallel-size", "2"]


@pytest.mark.parametrize("world, layout, zero", [
    pytest.param(2, TP2, "zero0", id="tp2"),
    pytest.param(2, TP2 + ["--sequence-parallel"], "zero0", id="tp2_sp"),
    pytest.param(2, PP2, "zero0", id="pp2"),
    pytest.param(2, [], "zero1", id="dp2_zero1"),
    pytest.param(2, [], "zero2", id="dp2_zero2"),
    pytest.param(2, [], "zero3", id="dp2_zero3"),
    pytest.param(4, TP2 + PP2, "zero0", id="tp2_pp2"),
    pytest.param(4, TP2, "zero3", id="tp2_dp2_zero3"),
    pytest.param(4, PP2, "zero1", id="pp2_dp2_zero1"),
    pytest.param(4, TP2 + PP2 + ["--sequence-parallel"], "zero1", id="tp2_pp2_sp"),
])
def test_layout_matches_single_process(world, layout, zero):
    assert_matches(reference(), parallel(world, layout, zero))


def test_pp4_with_tied_embeddings_matches_single_process():
    # The tied embedding lives on stage 0 and stage 3; DeepSpeed sums its two gradients.
    assert_matches(reference(), parallel(4, ["--pipeline-model-parallel-size", "4"], "zero0"))


def test_tp2_pp2_dp2_on_eight_ranks_matches_single_process():
    assert_matches(reference(), parallel(8, TP2 + PP2, "zero1"), tol=1e-5)


@pytest.mark.parametrize("layout, zero", [pytest.param(TP2, "zero1", id="tp2"), pytest.param(PP2, "zero1", id="pp2")])
def test_untied_output_layer_matches_single_process(layout, zero):
    assert_matches(reference(tuple(UNTIED)), parallel(2, layout, zero, tuple(UNTIED)))


def test_vocabulary_padding_that_depends_on_tp_changes_nothing():
    # Vocabulary 300 pads to 384 rows at TP=1 and 512 at TP=2. Padding rows start at zero and
    # stay out of the softmax, so the loss, the gradient norm and the real rows' gradients are
    # the single process's, and the padding gets no gradient. (A rank holding only padding:
    # tests/test_parallel_units.py.)
    variant = ("--vocab-size", "300", *UNTIED)
    want, got = dict(reference(variant)), parallel(2, TP2, "zero0", variant)
    want["grads"] = dict(want["grads"])  # the cached reference stays whole
    vocab_tensors = [name for name, g in want["grads"].items() if g.shape[0] == 384]
    assert len(vocab_tensors) == 2, vocab_tensors  # the embedding and the untied head
    for name in vocab_tensors:
        assert got["grads"][name].shape[0] == 512 and not got["grads"][name][300:].any(), name
        assert not want["grads"][name][300:].any(), name
        want["grads"][name], got["grads"][name] = want["grads"][name][:300], got["grads"][name][:300]
    assert_matches(want, got)


def test_gpt2_variant_with_biases_under_tp_and_sp_matches_single_process():
    # LayerNorm biases and row-parallel biases live in the sequence region: their gradients need the SP all-reduce.
    assert_matches(reference(tuple(GPT2)), parallel(2, TP2 + ["--sequence-parallel"], "zero0", tuple(GPT2)))


@pytest.mark.parametrize("recompute", [
    pytest.param(["--recompute-granularity", "full"], id="full_partitioned_activations"),
    pytest.param(["--recompute-granularity", "full", "--recompute-num-layers", "1", "--sequence-parallel"], id="full_one_layer_sp"),
    pytest.param(["--recompute-granularity", "selective"], id="selective"),
    pytest.param(["--recompute-granularity", "selective", "--recompute-modules", "core_attn", "mlp", "--sequence-parallel"],
                 id="selective_attention_and_mlp_sp"),
])
def test_activation_recompute_under_tp_matches_single_process(recompute):
    assert_matches(reference(), parallel(2, TP2 + recompute, "zero1"))


@pytest.mark.parametrize("modules", [["mlp"], ["core_attn", "mlp"]], ids=["mlp", "core_attn_and_mlp"])
def test_selective_recompute_changes_no_bit_of_the_single_process_run(modules):
    # The checkpoints begin at the norm's output and the attention core's inputs, which only the recomputed
    # part reads: every gradient is summed in the plain run's order (a checkpoint of norm + MLP from the
    # residual stream changed the last bits of 92,722 step-0 gradient elements of this model).
    single = reference()
    split = parallel(1, ["--recompute-granularity", "selective", "--recompute-modules", *modules], "zero0")
    assert split["losses"] == single["losses"] and split["grad_norms"] == single["grad_norms"]
    for name, grad in single["grads"].items():
        assert torch.equal(split["grads"][name], grad), name


@pytest.mark.parametrize("split", [["--decoder-first-pipeline-num-layers", "3"], ["--decoder-last-pipeline-num-layers", "3"]],
                         ids=["first_stage_3_layers", "last_stage_3_layers"])
def test_an_uneven_pipeline_split_matches_single_process(split):
    # Megatron-LM's flags: 3 of TINY's 4 layers on one stage of two, 1 on the other (embedding with the first, head and loss
    # with the last); the layer a stage holds changes nothing of what it computes.
    flags = TINY + PP2 + split + ds_config("zero0")
    held = run_ranks(2, _stage_contents, flags)
    assert held == ([(["Embedding"], 3), ([], 1)] if "--decoder-first-pipeline-num-layers" in split
                    else [(["Embedding"], 1), ([], 3)]), held
    assert_matches(reference(), parallel(2, PP2 + split, "zero0"))


def _stage_contents(flags: list[str]) -> tuple[list[str], int]:
    """(this stage's non-layer modules before its layers, its transformer layers)."""
    from hybridlm.config import parse_args
    from hybridlm.model.specs import transformer_layers
    from hybridlm.training.trainer import build_run, prepare_config
    run = build_run(*prepare_config(parse_args(flags)))
    module = run.engine.module
    first, _ = module.layer_steps.span
    return [type(f).__name__ for f in module.forward_funcs[:first]], len(transformer_layers(module))


def test_recompute_under_pipeline_matches_single_process():
    assert_matches(reference(), parallel(2, PP2 + ["--recompute-granularity", "full"], "zero1"))


@pytest.mark.slow
@pytest.mark.parametrize("world, layout, backend", [(1, [], "inductor"), (2, PP2, "aot_eager"),
                                                    (2, TP2 + ["--sequence-parallel"], "aot_eager")],
                         ids=["one_process", "pp2", "tp2_sp"])
def test_torch_compile_computes_the_eager_function(world, layout, backend):
    # Compiled layers (and the compiled loss with TP=1) reorder floating-point work, so this
    # holds to 1e-5 rather than bit for bit. One process checks Inductor's kernels; what PP and TP
    # add is which graphs dynamo captures and where they break (at each TP/SP collective), which
    # aot_eager traces forward and backward as Inductor's front half does, without Inductor's C++
    # build of each kernel of the TP shapes (about 30 s of a cold cache's CPU here). On GPUs,
    # tests/test_gpu.py runs these layouts through Inductor on NCCL.
    # A fresh clone's cold Inductor cache: 75 s under a loaded 2-core machine, too near run_ranks' default of 180 s.
    assert_matches(reference(), parallel(world, layout + ["--torch-compile", "--torch-compile-backend", backend], "zero1",
                                         timeout=600))
