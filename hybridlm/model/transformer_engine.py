"""Transformer Engine as the rank-local matmul of the tensor-parallel linears, and FP8.

``--transformer-impl transformer_engine`` keeps this project's TP/SP communication (the
column/row linears in ``parallel.tensor_parallel``) and swaps only the local GEMM for TE's
``Linear``, so that inside ``fp8_autocast`` the GEMM runs in FP8 with TE's scaling state.
The TE module computes with *our* parameters (same names, same sharding tags, same
initialisation and checkpoints as the local implementation); it is kept off the module
tree, so its FP8 scaling history is not part of a checkpoint (a resumed FP8 run rebuilds
the amax history within ``--fp8-amax-history-len`` steps).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from ..config import ModelConfig


@dataclass
class MicroBatchPhase:
    """Where the running forward sits in an optimizer step, for TE's FP8 weight cache.

    Weights change only at the optimizer step, so their FP8 casts (and transposes) made in
    the first micro-batch serve every later one of the same step (TE's ``is_first_microbatch``;
    Megatron passes the same). The training loop sets ``first`` to True for a step's first
    micro-batch and False for the rest, and back to None after the step: None (evaluation,
    generation, the pipeline engine's own schedule) casts afresh and touches no cache."""
    first: Optional[bool] = None


class _TEModuleCall:
    """Calls a TE module (``self.module``) outside compiled graphs, telling it where in the step it runs.

    TE's autograd functions and FP8 scaling state are not traceable, so under --torch-compile a
    layer compiles only what lies between its GEMMs (``hybridlm.model.execution.compile_layer``)."""

    module: nn.Module
    phase: MicroBatchPhase

    @torch._disable_dynamo
    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.module(x, is_first_microbatch=self.phase.first)


class TELocalMatmul(_TEModuleCall):
    """y = x W^T (+ b) through ``transformer_engine.pytorch.Linear`` on the caller's parameters."""

    def __init__(self, weight: nn.Parameter, bias: Optional[nn.Parameter], phase: Optional[MicroBatchPhase] = None):
        import transformer_engine.pytorch as te
        out_features, in_features = weight.shape
        linear = te.Linear(in_features, out_features, bias=bias is not None, params_dtype=weight.dtype, device=weight.device)
        _adopt(linear, weight=weight, bias=bias)
        self.module, self.phase = linear, phase or MicroBatchPhase()


class TELocalNormMatmul(_TEModuleCall):
    """y = norm(x) W^T (+ b) through ``transformer_engine.pytorch.LayerNormLinear``: the norm and
    the GEMM's input cast (FP8 under autocast) in one kernel, on the caller's parameters.

    Used where a column-parallel linear directly follows a norm on the full sequence (QKV and a
    dense MLP's first linear, without sequence parallelism: with SP an all-gather sits between
    the two). The norm module stays registered where it was (its parameter names and
    checkpoints are unchanged); this object only reads its weight and epsilon."""

    def __init__(self, norm: nn.Module, weight: nn.Parameter, bias: Optional[nn.Parameter],
                 phase: Optional[MicroBatchPhase] = None):
        import transformer_engine.pytorch as te
        out_features, in_features = weight.shape
        fused = te.LayerNormLinear(in_features, out_features, eps=float(norm.eps), bias=bias is not None,
                                   normalization=_normalization(norm), zero_centered_gamma=_zero_centered(norm),
                                   params_dtype=weight.dtype, device=weight.device)
        _adopt(fused, **_norm_params(norm), weight=weight, bias=bias)
        self.module, self.phase = fused, phase or MicroBatchPhase()


class TELocalNormMLP(_TEModuleCall):
    """y = act(norm(x) W1^T) W2^T through ``transformer_engine.pytorch.LayerNormMLP``, on the
    caller's parameters (this rank's shards: W1's rows, W2's columns; no biases).

    Beyond LayerNormLinear for fc1, TE computes the activation (SwiGLU's gate and product, or
    GELU) and its FP8 cast in one kernel, and its gradient with the cast of fc1's output
    gradient, instead of a bf16 round trip through memory and a separate quantisation; the
    block is one call, so a compiled layer also has two fewer graph breaks."""

    ACTIVATIONS = {"swiglu": "swiglu", "gelu_tanh": "gelu"}  # ours -> TE's ("gelu" is the tanh form)

    def __init__(self, norm: nn.Module, fc1_weight: nn.Parameter, fc2_weight: nn.Parameter, activation: str,
                 phase: Optional[MicroBatchPhase] = None):
        import transformer_engine.pytorch as te
        hidden, ffn = fc2_weight.shape
        fused = te.LayerNormMLP(hidden, ffn, eps=float(norm.eps), bias=False, normalization=_normalization(norm),
                                zero_centered_gamma=_zero_centered(norm), activation=self.ACTIVATIONS[activation],
                                params_dtype=fc1_weight.dtype, device=fc1_weight.device)
        _adopt(fused, **_norm_params(norm), fc1_weight=fc1_weight, fc2_weight=fc2_weight)
        self.module, self.phase = fused, phase or MicroBatchPhase()


class TEGroupedMatmul(_TEModuleCall):
    """Rows grouped by expert (``splits[e]`` rows each) times ``weight[e]^T`` through
    ``transformer_engine.pytorch.GroupedLinear`` (one GEMM per expert, FP8 under autocast) on the
    caller's stacked ``[experts, out, in]`` parameter.

    TE keeps one parameter per expert; ours is one tensor (its EP/TP tags, ZeRO partitioning and
    checkpoints are per matrix), so the TE module is built without weights and handed this call's
    per-expert views of ours: their gradients flow back into the stacked parameter."""

    def __init__(self, weight: nn.Parameter, phase: Optional[MicroBatchPhase] = None):
        import transformer_engine.pytorch as te
        experts, out_features, in_features = weight.shape
        grouped = te.GroupedLinear(experts, in_features, out_features, bias=False, params_dtype=weight.dtype, device="meta")
        for i in range(experts):  # no weights of its own (built on "meta": nothing was allocated)
            delattr(grouped, f"weight{i}")
            setattr(grouped, f"bias{i}", torch.empty(0, dtype=weight.dtype, device=weight.device))  # TE's "no bias"
        self.module, self.weight, self.phase = grouped, weight, phase or MicroBatchPhase()

    @torch._disable_dynamo
    def __call__(self, x: torch.Tensor, splits: list[int]) -> torch.Tensor:
        for i, view in enumerate(self.weight.unbind(0)):  # TE reads weight0.. by attribute name at every call
            self.module.__dict__[f"weight{i}"] = view
        return self.module(x, splits, is_first_microbatch=self.phase.first)


class TEGroupedExperts:
    """An MoE layer's experts, ``w2 . act . w1`` on rows sorted by expert, through two
    ``TEGroupedMatmul`` (Megatron-core's TEGroupedMLP): FP8 GEMMs under autocast, where torch's
    grouped GEMM has only bf16. FP8 GEMMs want each expert's rows in multiples of 16 (32 for
    MXFP8), so each group is padded with zero rows on the way in and cut back on the way out
    (TE's ``Fp8Padding``); a zero row stays zero through SwiGLU and GELU and is dropped.

    TE's grouped GEMM takes the rows per expert on the host: one synchronisation per layer and
    micro-batch (EP already has one, for the all-to-all; Megatron-core's has the same)."""

    def __init__(self, w1: nn.Parameter, w2: nn.Parameter, activation, phase: Optional[MicroBatchPhase] = None):
        import transformer_engine.pytorch as te
        phase = phase or MicroBatchPhase()
        self.fc1, self.fc2 = TEGroupedMatmul(w1, phase), TEGroupedMatmul(w2, phase)
        self.pad, self.unpad = te.Fp8Padding(w1.shape[0]), te.Fp8Unpadding(w1.shape[0])
        self.activation = activation

    def __call__(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        splits = counts.tolist()
        x, padded = self.pad(x, splits)
        return self.unpad(self.fc2(self.activation(self.fc1(x, padded)), padded), splits)


def te_modules_in(module: nn.Module) -> list[nn.Module]:
    """The TE modules that ``module``'s adapters call: off the module tree, ``modules()`` misses them.
    An adapter is an attribute of a submodule, or of a plain object held there (a fused norm + MLP
    block sits inside the callable that wraps it in the TP crossings)."""
    found = {}
    for m in module.modules():
        for value in vars(m).values():
            nested = () if isinstance(value, (nn.Module, dict)) else tuple(getattr(value, "__dict__", {}).values())
            for candidate in (value, *nested):
                if isinstance(candidate, _TEModuleCall):
                    found[id(candidate.module)] = candidate.module
    return list(found.values())


@contextlib.contextmanager
def fp8_scaling_kept(modules: list[nn.Module]):
    """TE modules leave with the FP8 scales and amax histories they came in with (sample passes
    inside, e.g. CUDA graph capture's, whose gradients are uninitialised memory, must not steer
    the scaling of the real ones); a module not yet run leaves fresh."""
    saved = [(m, m.get_fp8_meta_tensors()) for m in modules]
    try:
        yield
    finally:
        for m, tensors in saved:
            m.reset_fp8_meta_tensors(tensors)


def join_fp8_scaling(modules: list[nn.Module], recipe) -> None:
    """Put TE modules' delayed-scaling tensors into TE's global amax buffer, whose scales every
    FP8 autocast's exit (and the first module's backward) updates from the amax histories.

    A module joins by itself when it runs outside graph capture. A module that ran only under
    CUDA graph capture (TE raises its capture flag for the warm-up passes too) never joined, and
    its replays would quantise with its initial scales for good; joining is once and for all."""
    try:
        from transformer_engine.pytorch.quantization import FP8GlobalStateManager
    except ImportError:  # TE 1.x
        from transformer_engine.pytorch.fp8 import FP8GlobalStateManager
    for m in modules:
        if "scaling_fwd" in m.fp8_meta:
            m.fp8_meta.setdefault("recipe", recipe)
            m.fp8_meta.setdefault("fp8_group", None)
            FP8GlobalStateManager.add_fp8_tensors_to_global_buffer(m.fp8_meta)


def _normalization(norm: nn.Module) -> str:
    return "LayerNorm" if isinstance(norm, nn.LayerNorm) else "RMSNorm"


def _zero_centered(norm: nn.Module) -> bool:
    """--apply-layernorm-1p: TE's zero_centered_gamma computes the same 1 + weight gain."""
    return bool(getattr(norm, "zero_centered", False))


def _norm_params(norm: nn.Module) -> dict:
    params = {"layer_norm_weight": norm.weight}
    if isinstance(norm, nn.LayerNorm):
        params["layer_norm_bias"] = norm.bias
    return params


def _adopt(module: nn.Module, **params: Optional[nn.Parameter]) -> None:
    """Point a TE module's parameters at ours (TE reads them by attribute name at every call),
    so that it holds no weights of its own; a None leaves TE's (absent bias) as it is."""
    for name, param in params.items():
        if param is not None:
            delattr(module, name)
            setattr(module, name, param)


def fp8_recipe(cfg: ModelConfig):
    """TE's recipe object for ``--fp8-format``/``--fp8-recipe``, or None without FP8."""
    if not cfg.fp8_format:
        return None
    from transformer_engine.common import recipe
    fmt = recipe.Format.HYBRID if cfg.fp8_format == "hybrid" else recipe.Format.E4M3
    if cfg.fp8_recipe == "current":
        return recipe.Float8CurrentScaling(fp8_format=fmt)
    return recipe.DelayedScaling(fp8_format=fmt, amax_history_len=cfg.fp8_amax_history_len,
                                 amax_compute_algo=cfg.fp8_amax_compute_algo)


def fp8_context(recipe_object):
    """The context FP8 runs under: TE's autocast, or nothing without FP8.

    A model built whole enters it once around its forward and each transformer layer again
    (nested: free), so that under delayed scaling TE updates the amax histories and scales once
    per forward and once per backward; a pipeline stage's layers each enter it alone."""
    if recipe_object is None:
        return contextlib.nullcontext()
    import transformer_engine.pytorch as te
    if hasattr(te, "autocast"):  # TE 2.x's name; fp8_autocast there warns on every call
        return te.autocast(enabled=True, recipe=recipe_object)
    return te.fp8_autocast(enabled=True, fp8_recipe=recipe_object)
