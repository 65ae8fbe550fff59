"""The model as a list of layer specs, and the two ways to run that list.

PP > 1: the list becomes a ``deepspeed.pipe.PipelineModule`` (1F1B via
``engine.train_batch``), each stage building only its own layers. PP = 1: the same list
is built whole into ``SequentialModel``, an ordinary module that ZeRO-2/3 and offload can
wrap. ``SequentialModel`` registers layers under the same names PipelineModule does (the
layer's index in the list, and ``tied_modules.<key>`` for tied layers), so a parameter
has one name in every layout: initialisation and checkpoints key on it. Both run their
transformer layers through ``LayerSteps`` (``hybridlm.model.execution``), where the execution
policy (layer context, recompute, compile) wraps them without renaming anything.
"""
from __future__ import annotations

from functools import partial
from typing import Callable, Optional

import torch
from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec
from torch import nn

from ..config import ModelConfig
from ..parallel.lora import add_adapters
from ..parallel.loss import LossReducer
from ..parallel.plan import LayerFactory
from ..parallel.quantized import QuantSpec, quantize_block_linears
from .execution import LayerSteps
from .gpt import Embedding, FinalNorm, LMLoss, OutputLayer, TransformerLayer, tied_head_logits, tied_output

TIED_KEY = "embed"
TIED_ATTR = "word_embeddings.weight"


class FinishedLayerSpec(LayerSpec):
    """A LayerSpec whose built module is handed to ``finish`` before the next layer is built (so that
    what ``finish`` frees, the dense weights a 4-bit base replaces, never exists for all layers at once)."""

    def __init__(self, finish: Callable[[nn.Module], None], typename, *args, **kwargs):
        super().__init__(typename, *args, **kwargs)
        self.finish = finish

    def build(self, log=False):
        module = super().build(log=log)
        self.finish(module)
        return module


def layer_specs(cfg: ModelConfig, factory: LayerFactory) -> list:
    tied = not cfg.untie_embeddings_and_output_weights
    embedding = (TiedLayerSpec(TIED_KEY, Embedding, cfg, factory, tied_weight_attr=TIED_ATTR) if tied
                 else LayerSpec(Embedding, cfg, factory))
    if cfg.quant_bits:  # QLoRA: the block linears in 4 bits (hybridlm.parallel.quantized)
        finish = partial(quantize_block_linears, spec=QuantSpec.of(cfg), tp=factory.tp)
        layers = [FinishedLayerSpec(finish, TransformerLayer, cfg, factory, layer_number=i) for i in range(cfg.num_layers)]
    else:
        layers = [LayerSpec(TransformerLayer, cfg, factory, layer_number=i) for i in range(cfg.num_layers)]
    head = (TiedLayerSpec(TIED_KEY, Embedding, cfg, factory, forward_fn=tied_output, tied_weight_attr=TIED_ATTR)
            if tied else LayerSpec(OutputLayer, cfg, factory))
    return [embedding, *layers, LayerSpec(FinalNorm, cfg, factory), head]


class SequentialModel(nn.Module):
    """All specs built in one process: forward(inputs, labels) -> loss, or logits without labels.
    A loss with ``select_positions(hidden, labels) -> (hidden, labels)`` picks the positions the
    head runs on (with a fine-tuning mask, about half of them: the head's GEMM over a 150k
    vocabulary is 15% of a 1.5B Qwen2's GEMM work, and its cross-entropy reads every logit).
    ``context`` wraps the run of transformer layers (the layer context: FP8 autocast, entered once
    around all of them as well as per layer, so that TE updates its scaling once per pass; the
    embedding and output head stay outside, in bf16)."""

    def __init__(self, specs: list, loss_fn, context: Optional[Callable] = None):
        super().__init__()
        self.loss_fn = loss_fn
        self.tied_modules = nn.ModuleDict()
        self.forward_funcs = []
        for index, spec in enumerate(specs):
            if isinstance(spec, TiedLayerSpec):
                if spec.key not in self.tied_modules:
                    self.tied_modules[spec.key] = spec.build()
                module = self.tied_modules[spec.key]
                self.forward_funcs.append(partial(spec.forward_fn, module) if spec.forward_fn else module)
            else:
                module = spec.build()
                self.add_module(str(index), module)
                self.forward_funcs.append(module)
        self.layer_steps = LayerSteps(self.forward_funcs, context)
        # where the loss computes the logits itself, chunk by chunk (GRPOLoss), the head hands it HeadLogits instead
        self.head_logits = _head_logits(self.forward_funcs[-1]) if getattr(loss_fn, "fused_head", False) else None

    def forward(self, inputs, labels=None):
        """``inputs``: tokens, or (tokens, position ids) when the batch carries them; ``labels``: what the loss takes."""
        x = inputs
        first, end = self.layer_steps.span
        for layer in self.forward_funcs[:first]:
            x = layer(x)
        if self.layer_steps.context is None:
            x = self.layer_steps(x)
        else:
            with self.layer_steps.context():
                x = self.layer_steps(x)
        *norms, head = self.forward_funcs[end:]
        for layer in norms:
            x = layer(x)
        select = getattr(self.loss_fn, "select_positions", None) if labels is not None else None
        if select is not None:  # the head and the loss only where the loss reads (MaskedLMLoss)
            x, labels = select(x, labels)
        if labels is None:
            return head(x)
        logits = self.head_logits(x) if self.head_logits is not None else None  # None: a TE or LoRA head
        return self.loss_fn(head(x) if logits is None else logits, labels)


def _head_logits(head) -> Optional[Callable]:
    """``head``'s ``HeadLogits`` maker (``hybridlm.parallel.fused_head``), or None for a head that has none."""
    if isinstance(head, OutputLayer):
        return head.head_logits
    if isinstance(head, partial) and head.func is tied_output:
        return partial(tied_head_logits, *head.args)
    return None


class PipelineModel(PipelineModule):
    """DeepSpeed's pipeline module (PP > 1: 1F1B through ``engine.train_batch``, each stage building
    its own layers), running its transformer layers through ``LayerSteps`` as ``SequentialModel``
    does. ``forward_funcs`` stays DeepSpeed's list of built layers (its checkpoints read it)."""

    def __init__(self, *args, layer_context: Optional[Callable] = None, stage_layers: Optional[list[int]] = None, **kwargs):
        self.stage_layers = stage_layers  # read by _partition_layers, which DeepSpeed's constructor calls
        super().__init__(*args, **kwargs)
        self.layer_steps = LayerSteps(self.forward_funcs, layer_context)

    def _partition_layers(self, method="uniform"):
        """DeepSpeed's split unless ``stage_layers`` gives each stage's transformer layers (Megatron-LM's
        --decoder-first/last-pipeline-num-layers): the embedding goes with the first stage's layers, the
        final norm, the output layer and the loss with the last's, as in the even split."""
        if self.stage_layers is None:
            return super()._partition_layers(method)
        self.parts = [0] + [1 + sum(self.stage_layers[:s]) for s in range(1, self.num_stages)] + [len(self._layer_specs)]
        stage = self._topo.get_coord(self.global_rank).pipe
        self._set_bounds(start=self.parts[stage], stop=self.parts[stage + 1])

    def forward(self, inputs):
        first, end = self.layer_steps.span
        for layer in self.forward_funcs[:first]:
            inputs = layer(inputs)
        inputs = self.layer_steps(inputs)
        for layer in self.forward_funcs[end:]:
            inputs = layer(inputs)
        return inputs


def build_model(cfg: ModelConfig, factory: LayerFactory, *, topology=None, loss=None,
                layer_context: Optional[Callable] = None, stage_layers: Optional[list[int]] = None) -> nn.Module:
    """A PipelineModel when ``topology`` has more than one stage, else a SequentialModel.
    ``loss(logits, labels)`` ends the model (default: next-token prediction, ``LMLoss``);
    ``layer_context``: what the transformer layers run under (FP8 autocast), the first of the
    execution wrappers (``hybridlm.model.execution``); ``stage_layers``: transformer layers per pipeline stage
    (default: DeepSpeed's even split)."""
    specs = layer_specs(cfg, factory)
    loss = loss or LMLoss(LossReducer(factory.tp, factory.groups.cp, factory.sequence_parallel), cfg.vocab_size)
    if topology is not None and topology.get_dim("pipe") > 1:
        # no_grad: the constructor broadcasts the tied embedding from the first stage to the last in
        # place (DeepSpeed's _synchronize_tied_weights), a copy no gradient should flow through; with
        # grad mode on, c10d's broadcast_ (no autograd kernel) leaves the parameter warning at every
        # backward that it "may lead to silently incorrect behavior"
        with torch.no_grad():
            model = PipelineModel(layers=specs, loss_fn=loss, topology=topology, layer_context=layer_context,
                                  partition_method=f"type:{TransformerLayer.__name__}", activation_checkpoint_interval=0,
                                  stage_layers=stage_layers)
    else:
        model = SequentialModel(specs, loss, context=layer_context)
    if cfg.lora_rank:  # adapters on this stage's target linears, the rest frozen (hybridlm.parallel.lora)
        add_adapters(model, cfg, factory)
    return model


def local_layers(model: nn.Module) -> list:
    """The layer callables this rank runs, in order."""
    return list(model.forward_funcs)


def transformer_layers(model: nn.Module) -> list:
    """This rank's transformer layers, in order."""
    return [f for f in local_layers(model) if isinstance(f, TransformerLayer)]
