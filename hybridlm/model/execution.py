"""How a stage runs its transformer layers: execution policy, applied to the built layer list.

The blocks (``gpt.py``) hold only their arithmetic. How they run is decided here, by wrappers that
``build_model`` and the trainer apply to the layer list, in this order (torchtitan's: recompute,
then compile):

  1. the layer context (Transformer Engine's FP8 autocast) around each step, when the model is built;
  2. activation recompute: selective (``apply_selective_recompute``: the attention core, the MLP or the MoE block) or full
     (``apply_recompute``: a layer, or a unit of consecutive layers, keeps only its input);
  3. compile (``compile_layers``): each layer's arithmetic, or only the pieces between its GEMMs when
     those belong to another library;
  4. CUDA graphs (``cuda_graphs.capture_layers``), once DeepSpeed has placed the parameters.

A wrapper never changes a parameter's name: the layers stay registered where the layer list put
them (``forward_funcs``: initialisation and checkpoints key on those names), and a model runs its
``LayerSteps``, callables over them.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import nn

from ..parallel.random import recompute_in_backward
from ..parallel.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from .gpt import MLP, MoEMLP, TransformerLayer


class InContext:
    """Runs ``step`` under ``context()`` (FP8 autocast: a pipeline stage's layers each enter it alone)."""

    def __init__(self, step: Callable, context: Callable):
        self.step, self.context = step, context

    def __call__(self, inputs):
        with self.context():
            return self.step(inputs)


class RecomputedLayers:
    """Consecutive transformer layers run as one unit that, in training, keeps only its input and
    runs again in backward (``checkpoint``: ``hybridlm.parallel.random.recompute_in_backward``)."""

    def __init__(self, layers: list[TransformerLayer], checkpoint: Callable):
        self.layers, self.checkpoint = layers, checkpoint

    def _compute(self, x, positions=None):
        for layer in self.layers:
            x = layer.compute(x, positions)
        return x

    def __call__(self, inputs):
        if not self.layers[0].training:
            for layer in self.layers:
                inputs = layer(inputs)
            return inputs
        if isinstance(inputs, tuple):
            x, positions = inputs
            return self.checkpoint(self._compute, x, positions), positions
        return self.checkpoint(self._compute, inputs)


class Recomputed:
    """``function`` recomputed in backward while ``owner`` trains (selective recompute)."""

    def __init__(self, function: Callable, owner: nn.Module, checkpoint: Callable):
        self.function, self.owner, self.checkpoint = function, owner, checkpoint

    def __call__(self, *args):
        if not self.owner.training:
            return self.function(*args)
        while args and args[-1] is None:  # DeepSpeed's checkpoint takes tensors: leave trailing Nones out
            args = args[:-1]
        return self.checkpoint(self.function, *args)


class LayerSteps:
    """A stage's transformer layers (``span``: where they sit in its layer list) and the steps that
    run them, in order: each step one layer, or a recompute unit of several, under the layer context."""

    def __init__(self, funcs: list, context: Optional[Callable] = None):
        blocks = [i for i, f in enumerate(funcs) if isinstance(f, TransformerLayer)]
        self.span = (blocks[0], blocks[-1] + 1) if blocks else (0, 0)
        self.layers: list[TransformerLayer] = list(funcs[self.span[0]:self.span[1]])
        self.context = context
        self.steps = [self._in_context(layer) for layer in self.layers]
        self.units: list[list[TransformerLayer]] = []  # the recompute units

    def _in_context(self, step: Callable) -> Callable:
        return step if self.context is None else InContext(step, self.context)

    def recompute(self, units: list[list[TransformerLayer]], checkpoint: Callable) -> None:
        """Each unit (consecutive layers from the first on) recomputed as one; the layers after them as they were."""
        covered = sum(len(unit) for unit in units)
        self.units = units
        self.steps = ([self._in_context(RecomputedLayers(unit, checkpoint)) for unit in units]
                      + [self._in_context(layer) for layer in self.layers[covered:]])

    def recomputed(self) -> list[bool]:
        """Per layer: whether backward recomputes it."""
        return [any(layer is other for unit in self.units for other in unit) for layer in self.layers]

    def __call__(self, inputs):
        for step in self.steps:
            inputs = step(inputs)
        return inputs


def apply_recompute(model: nn.Module, num_layers: int | None, method: str | None = None,
                    checkpoint: Callable = recompute_in_backward) -> int:
    """Full recompute of this stage's transformer layers, as Megatron-LM's ``--recompute-method``:
    ``block`` (or none given) recomputes the first ``num_layers`` layers (all if None), each one
    checkpoint; ``uniform`` checkpoints every group of ``num_layers`` consecutive layers as one
    unit (its input is all that is kept). Returns the number of checkpointed units."""
    steps: LayerSteps = model.layer_steps
    blocks = steps.layers
    if method != "uniform":
        units = [[block] for block in (blocks if num_layers is None else blocks[:num_layers])]
    else:
        units = [blocks[i:i + num_layers] for i in range(0, len(blocks), num_layers)]
    steps.recompute(units, checkpoint)
    return len(units)


def apply_selective_recompute(model: nn.Module, modules=("core_attn",), checkpoint: Callable = recompute_in_backward) -> None:
    """Selective recompute (``--recompute-granularity selective --recompute-modules ...``): the named parts
    of each layer keep only their inputs and run again in backward, as Megatron-LM's modules of those
    names. ``core_attn``: the attention core (what lies between the QKV projection and the output
    projection, after RoPE), whose tensors are large and cheap to rebuild at short sequences; ``mlp``: a
    dense layer's MLP, which at long sequences keeps more than attention does and costs far less to
    rebuild; ``moe``: an MoE layer's router and routed (and shared) experts.

    The MLP and MoE checkpoints start after the norm, at the block's own input, not at the residual
    stream: a tensor read on both sides of a checkpoint has its gradient summed in another order (the
    checkpoint's part first, then the rest), and the residual stream is read by the norm (twice) and the
    residual add. That moves the last bits of every gradient below, and AdamW's first step,
    ~lr x g / (|g| + eps), turns last-bit noise in a gradient below eps into a visibly different update
    (4e-5 in the next loss in tests). The norm's output is read only inside the block, so its gradients
    are the plain run's bit for bit. (Where fc1 or a fused block took the norm over, the block's input
    is the residual stream, as in Megatron's fused LayerNorm-linear.)"""
    for layer in model.layer_steps.layers:
        if "core_attn" in modules:
            layer.attention.attend = Recomputed(layer.attention.attend, layer.attention, checkpoint)
        if ("moe" if isinstance(layer.mlp, MoEMLP) else "mlp") in modules:
            layer.mlp.forward = Recomputed(layer.mlp.forward, layer.mlp, checkpoint)


def gemms_outside_graphs(layer: TransformerLayer) -> bool:
    """Whether the layer's GEMMs belong to another library (Transformer Engine's), which compiled
    graphs cannot contain: a linear calling a rank-local matmul of its own, or a fused norm + MLP block."""
    linears = (m for m in layer.modules() if isinstance(m, (ColumnParallelLinear, RowParallelLinear)))
    return any(m.local_matmul is not None for m in linears) or (isinstance(layer.mlp, MLP) and layer.mlp.fused is not None)


def compile_layer(layer: TransformerLayer, backend="inductor") -> None:
    """torch.compile the layer's arithmetic, leaving the layer context (Transformer Engine's FP8
    autocast, which dynamo cannot trace) and recompute outside the graph.

    When the GEMMs run outside compiled graphs (Transformer Engine's), compiling the whole
    block would cut it into a graph per fragment between them, each costing a guard check
    and a compiled-function call forward and backward, for fragments as small as a residual
    add; then only the pieces worth fusing are compiled: attention's middle (RoPE and the
    attention core), the activation and the norms that no GEMM took over."""
    if not gemms_outside_graphs(layer):
        layer.compute = torch.compile(layer.compute, backend=backend)
        return
    layer.attention.mix = torch.compile(layer.attention.mix, backend=backend)
    if not layer.attention.qkv.owns_norm:
        layer.input_norm.compile(backend=backend)
    if isinstance(layer.mlp, MLP):
        if not layer.mlp.owns_norm:
            layer.post_attention_norm.compile(backend=backend)
        if layer.mlp.fused is None:
            layer.mlp.activation = torch.compile(layer.mlp.activation, backend=backend)
    else:
        layer.post_attention_norm.compile(backend=backend)
        layer.mlp.compile(backend=backend)


def compile_layers(model: nn.Module, backend="inductor") -> int:
    """torch.compile this rank's transformer layers in place (parameter names unchanged).

    All layers share their graphs: dynamo treats module parameters as inputs, so the
    compile happens once per distinct layer shape, not once per layer. Under TP each layer
    is several graphs, split at the collectives (which run eagerly: ``parallel.sequence``)."""
    layers = model.layer_steps.layers
    for layer in layers:
        compile_layer(layer, backend)
    return len(layers)
