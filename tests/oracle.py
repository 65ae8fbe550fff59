"""The correctness oracle: a parallel layout must compute what one process computes.

``train_and_probe`` runs inside each rank: it builds the run from flags exactly as
``scripts/pretrain.py`` does, trains a few steps, and records every step's loss and
gradient norm (and, for MoE models, the aux and z losses) plus the full (TP- and
EP-gathered, all stages) gradients of step 1, read at the moment DeepSpeed is about to
apply them (after DP / expert-DP reduction and tied-weight reduction).
"""
from __future__ import annotations

import os

import torch

from hybridlm.presets import LLAMA_BLOCK, LLAMA_OPTIMIZER

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Smallest model that still exercises every path: GQA (4 heads, 2 groups), 4 layers for
# PP=4, vocab 512 (no padding at TP 1, 2 or 4, so every layout has the same full model), 4 micro-batches per step.
# The Llama-style block and optimiser are spelled out (LLAMA_BLOCK: RMSNorm, RoPE, SwiGLU, no biases, no
# dropout; LLAMA_OPTIMIZER: beta2 0.95, weight decay 0.1, cosine): flags left out take Megatron-LM's
# defaults (LayerNorm, learned positions, GeLU, biases, dropout 0.1, beta2 0.999, ...).
TINY = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--group-query-attention",
        "--num-query-groups", "2", "--ffn-hidden-size", "128", "--seq-length", "32", "--vocab-size", "512",
        *LLAMA_BLOCK, *LLAMA_OPTIMIZER, "--micro-batch-size", "2", "--global-batch-size", "8", "--lr", "1e-2",
        "--min-lr", "1e-3", "--lr-warmup-iters", "0", "--moe-aux-loss-coeff", "0.01", "--log-interval", "10",
        "--eval-iters", "10", "--seed", "7"]


def ds_config(name: str) -> list[str]:
    return ["--deepspeed_config", os.path.join(ROOT, "ds_configs", f"{name}.json")]


def train_and_probe(flags: list[str], steps: int = 3) -> dict:
    """Run ``steps`` optimizer steps; return losses, grad norms and step-1 full gradients."""
    import logging

    from deepspeed.utils import logger, safe_get_full_grad

    from hybridlm.config import parse_args
    from hybridlm.model.weights import gather_full_state_dict
    from hybridlm.training.moe_metrics import collect_moe_stats
    from hybridlm.training.trainer import build_run, data_iterator, prepare_config, train_step

    logger.setLevel(logging.WARNING)
    cfg, ds = prepare_config(parse_args(flags))
    run = build_run(cfg, ds)
    module = run.engine.module
    probe: dict = {}
    original_step = run.engine._take_model_step

    def step_with_probe(*args, **kwargs):
        if "grads" not in probe:  # step 1 only; every rank takes part in the gathers
            local = {name: safe_get_full_grad(p) for name, p in module.named_parameters()}
            probe["grads"] = gather_full_state_dict(local, module, run.ps.tp, run.ps.grad_reduction, run.ps.ep)
        return original_step(*args, **kwargs)

    run.engine._take_model_step = step_with_probe
    batches = data_iterator(run)
    losses, norms, moe = [], [], []
    for _ in range(steps):
        losses.append(train_step(run, batches).item())
        norm = run.engine.get_global_grad_norm()
        norms.append(None if norm is None else float(norm))
        moe.append(collect_moe_stats(module, cfg, run.ps))
    result = {"losses": losses, "grad_norms": norms, "grads": probe["grads"], "rank": run.ps.global_rank}
    if cfg.model.num_experts is not None:
        result.update(aux_losses=[m["aux_loss"] for m in moe], z_losses=[m["z_loss"] for m in moe], moe=moe,
                      expert_bias=_expert_biases(module))
    return result


def _expert_biases(module) -> dict:
    """{layer number: the router's expert bias after the run} over all stages (auxiliary-loss-free balancing)."""
    import torch.distributed as dist

    from hybridlm.parallel.moe import moe_layers
    mine = {layer.layer_number: layer.router.expert_bias.tolist() for layer in moe_layers(module)
            if layer.router.expert_bias is not None}
    everyone = [mine]
    if dist.is_initialized() and dist.get_world_size() > 1:
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
    biases: dict = {}
    for entry in everyone:
        for layer, bias in entry.items():
            assert biases.setdefault(layer, bias) == bias, f"ranks holding layer {layer} disagree on its expert bias"
    return biases


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def assert_matches(reference: dict, parallel: dict, tol: float = 1e-5) -> None:
    for key in ("losses", "grad_norms", "aux_losses", "z_losses"):  # zip below would stop at the shorter list
        want, got = len(reference.get(key, [])), len(parallel.get(key, []))
        assert want == got, f"{key}: {got} steps reported by the layout, {want} by the single process"
    for step, (want, got) in enumerate(zip(reference["losses"], parallel["losses"]), start=1):
        assert abs(got - want) <= tol * abs(want), f"step {step} loss {got!r} != single-process {want!r}"
    for key in ("aux_losses", "z_losses"):
        assert (key in reference) == (key in parallel), f"only one run reports {key}"
        for step, (want, got) in enumerate(zip(reference.get(key, []), parallel.get(key, [])), start=1):
            assert abs(got - want) <= tol * abs(want), f"step {step} {key[:-2]} {got!r} != single-process {want!r}"
    assert parallel.get("expert_bias") == reference.get("expert_bias"), "the expert biases moved differently"
    for step, (want, got) in enumerate(zip(reference["grad_norms"], parallel["grad_norms"]), start=1):
        assert want is not None and got is not None, f"step {step}: no grad norm reported (single {want!r}, layout {got!r})"
        assert abs(got - want) <= tol * abs(want), f"step {step} grad norm {got!r} != single-process {want!r}"
    assert set(parallel["grads"]) == set(reference["grads"]), "parameter names differ between layouts"
    for name, want in reference["grads"].items():
        got = parallel["grads"][name]
        assert got.shape == want.shape, f"{name}: gradient shape {tuple(got.shape)} != {tuple(want.shape)}"
        err = relative_error(got, want)
        assert err <= tol, f"{name}: step-1 gradient relative error {err:.2e} > {tol:.0e}"


def assert_flat_matmul_for_batch_major_rows(linear, weight: torch.Tensor) -> None:
    """``linear`` ([s, b, in] -> [s, b, out]) with the frozen ``weight`` [out, in], run forward and backward on an
    input and a gradient over batch-major memory (each row's features contiguous, the rows not one view): no
    batched matmul against the broadcast weight (torch's matmul picks one for such rows when the weight needs no
    gradient), and the values of x W^T and g W."""
    from torch.profiler import ProfilerActivity, profile
    out_features, in_features = weight.shape
    x = torch.randn(2, 8, in_features).transpose(0, 1).requires_grad_()
    grad = torch.randn(2, 8, out_features).transpose(0, 1)
    with profile(activities=[ProfilerActivity.CPU]) as run:
        out = linear(x)
        out.backward(grad)
    assert "aten::bmm" not in {event.key for event in run.key_averages()}, "a batched matmul against the broadcast weight"
    assert out.shape == (8, 2, out_features)
    assert torch.allclose(out.detach().reshape(-1, out_features), x.detach().reshape(-1, in_features) @ weight.t(), atol=1e-6)
    assert torch.allclose(x.grad.reshape(-1, in_features), grad.reshape(-1, out_features) @ weight, atol=1e-6)
