"""CUDA graphs of the transformer layers (``--cuda-graphs``).

Why: with Transformer Engine's FP8 GEMMs a layer's kernels finish sooner than the Python that
launches them (three TE module calls, the compiled pieces between them, autograd), so the GPU
waits on the host. A captured layer replays its forward as one graph launch, and its backward
as another, whatever the Python cost of the code that recorded them.

How: all of this rank's layers are captured in one call of TE's ``make_graphed_callables``
(forward in order, then backward in reverse, sharing one memory pool, as they will run). The
graphs read the parameters where they lie, so capture happens after DeepSpeed has moved them
into its flat buffers (ZeRO 1/2 then update them in place); replay happens only in training:
evaluation and generation run the layers' ordinary forward.

FP8: TE's version keeps amax/scale updates outside the graphs and, with FP8 weight caching,
skips the graph's weight casts on a flag the replay sets from ``MicroBatchPhase`` (a step's first
micro-batch recasts). Our TE modules sit off the module tree, where TE's capture does not look,
so the scaling state that capture's sample passes touch is saved and restored here, and the
modules are enrolled in TE's amax buffer here (all of them: the fused norm + MLP block's module
too, whose omission once left captured FP8 layers 0.6% off the uncaptured ones from a step's
second micro-batch on; tests/test_cuda_graphs.py checks outputs, gradients and scales).
"""
from __future__ import annotations

import contextlib
from typing import Callable, Optional

import torch
from torch import nn

from .transformer_engine import MicroBatchPhase, fp8_context, fp8_scaling_kept, join_fp8_scaling, te_modules_in


class LayerGraph:
    """A captured layer: ``replay(x)`` runs its forward graph, and autograd its backward graph.

    Every micro-batch must have the captured shape; the replay copies ``x`` into the graph's
    static input. ``keep_alive`` holds tensors the graph reads that the layer could otherwise
    drop (RoPE's cos/sin cache is replaced when another sequence length comes by)."""

    def __init__(self, replay: Callable, shape: torch.Size, phase: Optional[MicroBatchPhase], keep_alive=()):
        self.replay, self.shape, self.phase, self.keep_alive = replay, shape, phase, tuple(keep_alive)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape != self.shape:
            raise RuntimeError(f"--cuda-graphs: the layers were captured for activations of shape {tuple(self.shape)}, "
                               f"but a micro-batch gave {tuple(x.shape)}; every training micro-batch must have the same size.")
        if self.phase is None:
            return self.replay(x)
        # None (outside the training loop's steps) recasts, as the uncaptured layer does
        return self.replay(x, is_first_microbatch=self.phase.first is not False)


class ReplayInTraining:
    """A captured layer's forward (set on the instance, as TE sets its replay): the graph in training
    on activations alone, the layer's own forward otherwise (evaluation, generation; a pair with
    position ids is never captured). The layer class knows nothing of it."""

    def __init__(self, layer: nn.Module, graph: LayerGraph):
        self.layer, self.graph = layer, graph
        self.eager = type(layer).forward.__get__(layer)

    def __call__(self, inputs):
        if self.layer.training and not isinstance(inputs, tuple):
            return self.graph(inputs)
        return self.eager(inputs)


@contextlib.contextmanager
def grad_hooks_paused(params):
    """Parameters' post-accumulate-grad hooks (DeepSpeed's ZeRO 1/2 and bf16 optimizers put their
    gradient bookkeeping there) do not fire inside: capture runs backward passes whose gradients
    are samples, and a hook's kernels would be recorded into the graph and replayed every step.

    Each parameter's hook dictionary is swapped for an empty one and put back after, so that
    the handles DeepSpeed holds stay valid."""
    saved = [(p, p._post_accumulate_grad_hooks) for p in params if p._post_accumulate_grad_hooks is not None]
    for p, _ in saved:
        p._post_accumulate_grad_hooks = {}
    try:
        yield
    finally:
        for p, hooks in saved:
            p._post_accumulate_grad_hooks = hooks


def capture_layers(layers: list[nn.Module], shape: tuple[int, ...], *, recipe=None,
                   phase: Optional[MicroBatchPhase] = None, warmup: int = 3) -> None:
    """Capture ``layers`` (transformer layers, in order, in training mode) for activations of
    ``shape`` [sequence, micro-batch, hidden]; from then on each layer's training forward replays
    its graph (``ReplayInTraining``). ``recipe``: the FP8 recipe (None: no FP8); ``phase``: with FP8, where the step is
    (weight casts cached across its micro-batches)."""
    import transformer_engine.pytorch as te
    first = next(layers[0].parameters())
    samples = tuple((torch.randn(shape, device=first.device, dtype=first.dtype, requires_grad=True),) for _ in layers)
    fp8 = recipe is not None
    params = [p for layer in layers for p in layer.parameters()]
    te_modules = [m for layer in layers for m in te_modules_in(layer)]
    caches = [_read_caches(layer, shape[0]) for layer in layers]  # built before any compiled call sees them missing
    with grad_hooks_paused(params), fp8_scaling_kept(te_modules):
        _first_calls_outside_capture(layers, samples, recipe)
        te.make_graphed_callables(tuple(layers), samples, num_warmup_iters=warmup, enabled=fp8, recipe=recipe,
                                  cache_quantized_params=fp8)
    if fp8:
        join_fp8_scaling(te_modules, recipe)
    for layer, cache in zip(layers, caches):
        replay = layer.__dict__.pop("forward")  # TE set the replay as the instance's forward
        layer.forward = ReplayInTraining(layer, LayerGraph(replay, torch.Size(shape), phase if fp8 else None, keep_alive=cache))


def _first_calls_outside_capture(layers, samples, recipe, calls: int = 2) -> None:
    """Forward and backward of each layer before TE's capture, gradients discarded.

    A layer compiled whole (``--torch-compile`` without TE's GEMMs) is guarded on its
    submodules' hooks. TE's warmup runs the layers with a forward hook on every submodule and
    removes the hooks before capturing, so a layer first compiled in that warmup recompiles
    inside the capture, where compiling fails (the bf16 reference model did, on an H200). Called
    here without hooks, the capture finds its graph cached. One call builds it (the test says so);
    the default of two was for the RoPE tables a first call once cached (a guard the second call
    failed), and stays until a GPU run shows one is enough with TE. (Captured, such a
    layer then gave NaN input gradients on H200s, so start-up refuses the combination for now.)"""
    on_gpu = samples[0][0].is_cuda
    with torch.cuda.stream(torch.cuda.Stream()) if on_gpu else contextlib.nullcontext(), fp8_context(recipe):
        for _ in range(calls):
            for layer, (x,) in zip(layers, samples):
                y = layer(x)
                torch.autograd.grad(y, (x, *layer.parameters()), torch.ones_like(y), allow_unused=True)
    if on_gpu:
        torch.cuda.synchronize()


def _read_caches(layer: nn.Module, seq_len: int) -> tuple:
    rotary = getattr(layer.attention, "rotary", None)
    return rotary.cos_sin(seq_len, next(layer.parameters()).device) if rotary is not None else ()
