"""The GPT, written once: embedding, transformer layer, final norm, output head, loss.

Llama-style by default (RMSNorm, RoPE, SwiGLU, grouped-query attention, no biases); the
GPT-2 variant (LayerNorm, GeLU, learned positions, biases) is the same code with other
config values; Mixtral-style MoE swaps the MLP of every k-th layer for routed experts.
Activations are [sequence, batch, hidden]: the layout sequence parallelism splits along
dimension 0.

Every layer is built through a ``LayerFactory`` (``hybridlm.parallel.plan``): the blocks
never ask whether they are tensor-, sequence- or context-parallel; the factory hands out
linears whose outputs or inputs are split, the attention core over the whole sequence, and
says where activations enter the sequence-sharded region. A block holds only its
arithmetic: how it runs (recompute, compile, CUDA graphs) is ``hybridlm.model.execution``'s. Each block takes one tensor
and returns one, so the list of blocks is also the pipeline's list of stages' layers;
when the batch carries position ids [b, s] that "tensor" is the pair (activations, position
ids), which the pipeline engine sends between stages with the activations. Packed samples
(fine-tuning) restart their positions at 0 where a sample begins, which is all RoPE and
attention need to keep samples apart; under context parallelism a rank's rows are slices of
the sequence, and their positions say where each token sits in it (the data side slices them
with the tokens), which is all RoPE needs of the layout.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ModelConfig
from ..ops import reference as reference_ops
from ..parallel.fused_head import HeadLogits
from ..parallel.loss import LossReducer, loss_scales, scaled_loss
from ..parallel.plan import LayerFactory
from ..parallel.tensor_parallel import scaled_init_std
from .attention import Rotary
from .attention_backends import make_attention_core, make_block_attention, resolve_backend
from .weights import mark_vocabulary_rows


class RMSNorm(nn.Module):
    """Normalise in fp32, scale in the input dtype (the Llama / Hugging Face definition);
    ``kernel`` computes it (hybridlm.ops: a fused kernel, or the PyTorch definition). With
    ``zero_centered`` the gain is 1 + weight (Megatron-LM's --apply-layernorm-1p)."""

    def __init__(self, dim: int, eps: float, device=None, dtype=None, kernel=reference_ops.rms_norm, zero_centered=False):
        super().__init__()
        self.eps, self.kernel, self.zero_centered = eps, kernel, zero_centered
        self.weight = nn.Parameter(torch.ones(dim, device=device, dtype=dtype))

    def forward(self, x):
        return self.kernel(x, self.weight + 1 if self.zero_centered else self.weight, self.eps)


class LayerNorm1p(nn.LayerNorm):
    """LayerNorm whose gain is 1 + weight (Megatron-LM's --apply-layernorm-1p: the weight starts at 0)."""
    zero_centered = True

    def forward(self, x):
        return F.layer_norm(x, self.normalized_shape, self.weight + 1, self.bias, self.eps)


def make_norm(cfg: ModelConfig, factory: LayerFactory) -> nn.Module:
    one_p, place = cfg.apply_layernorm_1p, dict(device=factory.device, dtype=factory.dtype)
    if cfg.normalization == "LayerNorm":
        module = (LayerNorm1p if one_p else nn.LayerNorm)(cfg.hidden_size, eps=cfg.norm_epsilon, **place)
    else:
        module = RMSNorm(cfg.hidden_size, cfg.norm_epsilon, **place, kernel=factory.kernels.rms_norm, zero_centered=one_p)
    return factory.norm(module, weight=0.0 if one_p else 1.0)


class Embedding(nn.Module):
    """Token ids [batch, seq] -> hidden states [seq, batch, hidden] in the layers' layout."""

    def __init__(self, cfg: ModelConfig, factory: LayerFactory):
        super().__init__()
        self.factory, self.rng = factory, factory.rng
        self.word_embeddings = factory.embedding(cfg.padded_vocab_size, cfg.hidden_size, init_std=cfg.init_method_std)
        mark_vocabulary_rows(self.word_embeddings.weight, cfg.vocab_size)
        self.position_embeddings = None
        if cfg.position_embedding_type == "learned_absolute":
            table = nn.Parameter(torch.empty(cfg.max_position_embeddings, cfg.hidden_size, device=factory.device,
                                             dtype=factory.dtype))
            self.position_embeddings = factory.replicated(table, init_std=cfg.init_method_std)
        self.dropout = cfg.hidden_dropout

    def forward(self, inputs):
        """``inputs``: tokens [b, s], or (tokens, position ids [b, s]) when the batch carries them
        (packed samples; context parallelism): then the output is (hidden states, position ids) for
        the layers after it."""
        tokens, positions = inputs if isinstance(inputs, tuple) else (inputs, None)
        x = self.word_embeddings(tokens.t())
        if self.position_embeddings is not None:
            table = self.position_embeddings
            x = x + (table[: x.shape[0]].unsqueeze(1) if positions is None else table[positions.t()])
        x = self.factory.enter_sequence_region(x)
        if self.dropout and self.training:
            with self.rng.region():
                x = F.dropout(x, self.dropout)
        return x if positions is None else (x, positions)


class Attention(nn.Module):
    """``input_norm``: the norm before it, offered to the QKV linear to fuse (``qkv.owns_norm``)."""

    def __init__(self, cfg: ModelConfig, factory: LayerFactory, *, input_norm: nn.Module | None = None):
        super().__init__()
        self.rng, self.head_dim = factory.rng, cfg.kv_channels
        q, kv = cfg.num_attention_heads * cfg.kv_channels, cfg.num_query_groups * cfg.kv_channels
        self.qkv = factory.column_linear(cfg.hidden_size, [q, kv, kv], bias=cfg.add_bias_linear or cfg.add_qkv_bias,
                                         init_std=cfg.init_method_std, input_norm=input_norm)
        self.proj = factory.row_linear(q, cfg.hidden_size, bias=cfg.add_bias_linear,
                                       init_std=scaled_init_std(cfg.init_method_std, cfg.num_layers))
        self.rotary = (Rotary(cfg.kv_channels, cfg.rotary_base, kernel=factory.kernels.rotary)
                       if cfg.position_embedding_type == "rope" else None)
        self.packed = cfg.packed_samples  # position ids restart per sample (else: every row's are the same)
        backend, _ = resolve_backend(cfg.attention_backend, cfg.attention_dropout, cfg.graphed_attention_shape,
                                     packing=cfg.packed_samples, half_precision=cfg.half_precision)
        core = make_attention_core(backend, heads=cfg.num_attention_heads // factory.tp.size,
                                   groups=cfg.num_query_groups // factory.tp.size, head_dim=cfg.kv_channels,
                                   dropout=cfg.attention_dropout)
        self.core = factory.attention(core, make_block_attention(cfg.attention_block_kernel))
        self.dropout = cfg.attention_dropout

    def attend(self, q, k, v, positions=None):
        """The attention core (what selective recompute recomputes), with its dropout's random stream."""
        if not (self.dropout and self.training):
            # no random numbers drawn: skip the RNG-tracker fork (a state swap that also
            # splits a compiled layer into two graphs)
            return self.core(q, k, v, 0.0, positions)
        with self.rng.split():
            return self.core(q, k, v, self.dropout, positions)

    def forward(self, x, positions=None):
        return self.proj(self.mix(self.qkv(x), positions))

    def mix(self, qkv, positions=None):
        """What lies between the two linears: split into heads, RoPE, attention, merge heads.
        ``positions`` [b, s]: the rows' positions when the batch carries them: RoPE rotates each token by
        its own, and packed samples (positions restarting) attend only within themselves."""
        q, k, v = qkv.split(self.qkv.local_sizes, dim=-1)
        s, b = q.shape[:2]
        q = q.view(s, b, -1, self.head_dim)
        k = k.reshape(s, b, -1, self.head_dim)
        v = v.reshape(s, b, -1, self.head_dim)
        if self.rotary is not None:
            rope = positions if self.packed or positions is None else positions[0]  # unpacked rows: one table for all
            tables = self.rotary.tables(s, q.device, rope)
            q, k = self.rotary.apply(q, tables), self.rotary.apply(k, tables)
        return self.attend(q, k, v, positions if self.packed else None).reshape(s, b, -1)


class MLP(nn.Module):
    """``input_norm``: the norm before it, offered to fc1 (``fc1.owns_norm``) or to a fused
    norm + MLP block (Transformer Engine's LayerNormMLP); ``owns_norm`` says whether either took it."""

    def __init__(self, cfg: ModelConfig, factory: LayerFactory, ffn_hidden_size: int | None = None,
                 input_norm: nn.Module | None = None):
        super().__init__()
        self.swiglu = factory.kernels.swiglu if cfg.swiglu else None  # [gate | up] -> silu(gate) * up
        ffn = ffn_hidden_size or cfg.ffn_hidden_size
        blocks = [ffn] * (2 if cfg.swiglu else 1)  # SwiGLU: [gate; up] in one matmul
        fuse_block = input_norm is not None and factory.fuses_norm_mlp(bias=cfg.add_bias_linear)
        self.fc1 = factory.column_linear(cfg.hidden_size, blocks, bias=cfg.add_bias_linear, init_std=cfg.init_method_std,
                                         input_norm=None if fuse_block else input_norm)
        self.fc2 = factory.row_linear(ffn, cfg.hidden_size, bias=cfg.add_bias_linear,
                                      init_std=scaled_init_std(cfg.init_method_std, cfg.num_layers))
        activation = "swiglu" if cfg.swiglu else "gelu_tanh"
        self.fused = factory.norm_mlp(input_norm, self.fc1, self.fc2, activation) if fuse_block else None
        self.owns_norm = self.fused is not None or self.fc1.owns_norm

    def forward(self, x):
        if self.fused is not None:
            return self.fused(x)
        return self.fc2(self.activation(self.fc1(x)))

    def activation(self, h):
        return self.swiglu(h) if self.swiglu is not None else F.gelu(h, approximate="tanh")


class MoEMLP(nn.Module):
    """Routed experts, plus a shared expert that every token also goes through when configured,
    its output scaled by sigmoid(x . g) with ``--moe-shared-expert-gate`` (Qwen2-MoE)."""

    def __init__(self, cfg: ModelConfig, factory: LayerFactory, layer_number: int):
        super().__init__()
        self.moe = factory.moe(cfg, layer_number)
        shared = cfg.moe_shared_expert_intermediate_size
        self.shared = MLP(cfg, factory, shared) if shared else None
        self.shared_gate = None
        if cfg.moe_shared_expert_gate:
            gate = nn.Parameter(torch.empty(1, cfg.hidden_size, device=factory.device, dtype=factory.dtype))
            self.shared_gate = factory.replicated(gate, init_std=cfg.init_method_std, in_sequence_region=True)

    def forward(self, x):
        y = self.moe(x)
        if self.shared is None:
            return y
        shared = self.shared(x)
        if self.shared_gate is not None:
            shared = shared * torch.sigmoid(F.linear(x, self.shared_gate))
        return y + shared


class TransformerLayer(nn.Module):
    """Pre-norm block number ``layer_number`` (0-based; it decides MoE or dense MLP). Only the
    arithmetic: recompute, compile and CUDA graphs are wrappers applied to the layer list
    (``hybridlm.model.execution``)."""

    def __init__(self, cfg: ModelConfig, factory: LayerFactory, *, layer_number: int = 0):
        super().__init__()
        self.rng = factory.rng
        self.input_norm = make_norm(cfg, factory)
        self.attention = Attention(cfg, factory, input_norm=self.input_norm)
        self.post_attention_norm = make_norm(cfg, factory)
        if cfg.is_moe_layer(layer_number):  # the router reads the normalised input too: no fusion
            self.mlp = MoEMLP(cfg, factory, layer_number)
        else:
            self.mlp = MLP(cfg, factory, input_norm=self.post_attention_norm)
        self.dropout = cfg.hidden_dropout

    def attention_input(self, x):
        """What the attention block takes: the normalised residual, or the residual itself when
        its QKV linear fused the norm (Transformer Engine's LayerNormLinear)."""
        return x if self.attention.qkv.owns_norm else self.input_norm(x)

    def mlp_input(self, x):
        fused = isinstance(self.mlp, MLP) and self.mlp.owns_norm
        return x if fused else self.post_attention_norm(x)

    def _residual_dropout(self, x):
        if not (self.dropout and self.training):
            return x
        with self.rng.region():
            return F.dropout(x, self.dropout)

    def compute(self, x, positions=None):
        """The block's arithmetic: hidden states [s, b, h] -> hidden states; ``positions`` [b, s]: the
        rows' position ids, when the batch carries them."""
        x = x + self._residual_dropout(self.attention(self.attention_input(x), positions))
        return x + self._residual_dropout(self.mlp(self.mlp_input(x)))

    def forward(self, inputs):
        """hidden states -> hidden states, or (hidden states, position ids) -> the same pair."""
        if isinstance(inputs, tuple):
            x, positions = inputs
            return self.compute(x, positions), positions
        return self.compute(inputs)


class FinalNorm(nn.Module):
    def __init__(self, cfg: ModelConfig, factory: LayerFactory):
        super().__init__()
        self.norm = make_norm(cfg, factory)

    def forward(self, inputs):
        """The position ids stop here: the head and the loss need only the hidden states."""
        return self.norm(inputs[0] if isinstance(inputs, tuple) else inputs)


class OutputLayer(nn.Module):
    """Untied head: hidden -> logits over this rank's share of the vocabulary."""

    def __init__(self, cfg: ModelConfig, factory: LayerFactory):
        super().__init__()
        self.factory = factory
        self.linear = factory.column_linear(cfg.hidden_size, [cfg.padded_vocab_size], bias=False, init_std=cfg.init_method_std)
        mark_vocabulary_rows(self.linear.weight, cfg.vocab_size)

    def forward(self, x):
        return self.linear(x)

    def head_logits(self, x) -> HeadLogits | None:
        """The logits left to a loss that computes them chunk by chunk with the head's weight, or None where the
        head is more than that weight (Transformer Engine's matmul, a LoRA adapter's term)."""
        linear = self.linear
        if linear.local_matmul is not None or (linear.lora is not None and linear.lora.enabled):
            return None
        return self.factory.lm_head_logits(x, linear.weight)


def tied_output(embedding: Embedding, x):
    """Tied head: reuse the (vocab-split) input embedding as the output projection."""
    return embedding.factory.lm_logits(x, embedding.word_embeddings.weight)


def tied_head_logits(embedding: Embedding, x) -> HeadLogits:
    """The tied head's logits left to the loss (``OutputLayer.head_logits``)."""
    return embedding.factory.lm_head_logits(x, embedding.word_embeddings.weight)


class LMLoss:
    """Next-token cross-entropy of vocab-split logits [s, b, padded v/TP] against labels [b, s], over
    the ``vocab_size`` real entries (the padding, whose amount depends on TP, takes no part: the same
    model gives the same loss at every TP). One term of the loss contract (``hybridlm.parallel.loss``):
    the sum over the micro-batch's tokens, counted by its tokens. ``labels``: [b, s] (a micro-batch
    alone: its mean), or (labels, the step's scales) as the training step hands them."""

    def __init__(self, reducer: LossReducer, vocab_size: int | None = None):
        self.reducer, self.vocab_size = reducer, vocab_size

    @staticmethod
    def counts(labels: torch.Tensor) -> torch.Tensor:
        """[1]: every token of the micro-batch (this rank's slice of it under CP) counts."""
        return torch.full((1,), float(labels.numel()), dtype=torch.float64, device=labels.device)

    def __call__(self, logits, labels):
        labels, scales = labels if isinstance(labels, tuple) else (labels, None)
        if scales is None:
            scales = loss_scales(self.counts(labels), 1, 1)
        return scaled_loss(self.reducer.cross_entropy(logits, labels.t(), self.vocab_size).sum().reshape(1), scales)
