"""Bytes per GPU of one training layout: parameters, gradients, optimizer states, activations.

The figures follow what this code and DeepSpeed 0.19 actually allocate, not a textbook model;
each term names the tensors it counts. Ψ below is the parameter count one rank holds (its TP
shard of its pipeline stage's layers, experts divided over EP), DP the data-parallel size, and
B DeepSpeed's ``reduce_bucket_size`` (elements) from the JSON.

Model states, by DeepSpeed's optimizer path (``engine._do_optimizer_sanity_check``):

  fp32, ZeRO-0      params 4Ψ, Adam moments 8Ψ; grads 4Ψ exist from backward to the step
                    (then set to None); DP > 1 all-reduces them through a flat copy of up to B
  fp32, ZeRO-1/2    params 4Ψ (flattened), fp32 master partition 4Ψ/DP, moments 8Ψ/DP;
                    gradient reduce bucket(s) of B fp32 (two with overlap_comm) allocated at
                    every backward; ZeRO-1 keeps the full grads 4Ψ until the reduction, ZeRO-2
                    only its partition 4Ψ/DP
  fp32, ZeRO-3      params 4Ψ/DP plus the layers gathered at a time (up to the prefetch bucket),
                    master/moments 12Ψ/DP, grads 4Ψ/DP (a flat buffer), a reduce bucket of B and
                    the last reduce-scatter's copy; a tied embedding stays gathered (measured)
  bf16, ZeRO-0      PP = 1: DeepSpeed's fused FP16_Optimizer for bf16: params 2Ψ, grads 2Ψ,
                    fp32 master 4Ψ, moments 8Ψ, fp32 flat grads 4Ψ during the step;
                    PP > 1: BF16_Optimizer: master and moments partitioned over DP (12Ψ/DP),
                    fp32 grad accumulation 4Ψ
  bf16, ZeRO-1/2/3  as fp32 with 2-byte params and grads; master and moments stay fp32

The moments are 8Ψ in fp32; with --use-precision-aware-optimizer and bf16 or fp16 moments 2 bytes each.

Activations are what autograd keeps per transformer layer per micro-batch, counted with
autograd's saved-tensor hooks on this model's layers, in bytes per token of the micro-batch, with
h hidden, A = heads x head_dim, G = groups x head_dim, f the MLP width, t = TP, e = 2 (bf16) or 4:

  2 norms           PyTorch kernel: the fp32 input (fp32 runs: the input itself) and the
                    normalised tensor (e h); fused kernel: the input (e h). Under SP, / t
  2 linear inputs   the norms' outputs, kept by QKV and fc1 (e h each; under SP the linears
                    keep the gathered full-sequence input, so this term does not shrink with SP)
  attention         the QKV output (v is a view of it), rotated q and k, the kernel's output and
                    the projection input, as each kernel keeps them: torch SDPA as measured on a
                    CPU e(3A+3G)/t, cuDNN e(4A+3G)/t (GQA: k, v repeated to every head, e 5A/t),
                    flash-attn's contiguous copies e(3A+2G)/t
  SwiGLU MLP        fc1 output e 2f/t, silu(gate) e f/t (not with the fused kernel), fc2 input e f/t

Context parallelism (CP) gives each rank 1/CP of every sample's tokens: activations and logits
count the micro-batch's tokens / CP; ring attention (p2p) adds the K/V block in hand and the one
arriving (2 x e 2G/t per local token), dropped after the layer. To ZeRO a CP rank is one more
data-parallel replica: states are partitioned over DP x CP.

Full recompute keeps each layer's input (e h, split over TP by SP or DeepSpeed's partitioned
activations) and rebuilds one layer at a time in backward; selective recompute rebuilds the
attention kernel (its output is not kept), and with --recompute-modules mlp / moe a dense layer's
MLP or an MoE layer's router and experts (the norm stays outside: they keep only its output). Under 1F1B the first stage has min(PP, micro-batches)
micro-batches in flight. The last stage adds the cross-entropy over V/t of the vocabulary: at its
peak the logits (e) and one fp32 buffer (4) that is shifted, exponentiated and normalised in place,
the softmax that stays for backward; DeepSpeed's pipeline engine also keeps the logits of the
current and the previous micro-batch in its output buffers. What one layer rebuilds in backward
(recompute) and ring attention's K/V blocks exist only while that layer runs, never beside the
logits; at long sequences the logits are the largest term by far.

The peak is the largest of five moments of a step: the end of the last forward (all
activations, the cross-entropy's peak), the start of backward (ZeRO-1/2 allocate their reduce
buckets; the softmax is still kept), the last layer's backward (all activations and what one
layer's backward rebuilds and allocates, the logits gone), the first layer's backward
(nearly every gradient exists, one layer's activations are left, rebuilt if recomputed) and the
step (all gradients and the step's temporaries, no activations). Under PP the gradients exist from the first backward on, so they
count at every moment. Checked against measured peaks of real runs with benchmarks/plan_check.py
(benchmarks/RESULTS.md).
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Optional

from ..config import ModelConfig, pipeline_stage_layers

GIB = 2**30


@dataclass(frozen=True)
class Layout:
    """One candidate: how a model is split and trained. DP = world / (TP x PP x CP)."""

    tp: int = 1
    pp: int = 1
    dp: int = 1
    ep: int = 1
    cp: int = 1  # context parallelism: ranks splitting each sample's sequence (ring attention)
    zero: int = 0
    sequence_parallel: bool = False
    recompute: Optional[str] = None  # "full", "selective" or None
    recompute_modules: tuple = ("core_attn",)  # with "selective": what is rebuilt (--recompute-modules)
    micro_batch_size: int = 1
    grad_accum: int = 1  # micro-batches per optimizer step per DP rank
    bf16: bool = True
    offload_optimizer: bool = False  # ZeRO-1/2/3: master + moments (and the step) on the CPU
    moment_bytes: int = 8  # Adam's two moments a parameter: 8 in fp32, 4 in bf16 (--use-precision-aware-optimizer)
    offload_params: bool = False  # ZeRO-3: parameters on the CPU between uses
    reduce_bucket: float = 5e8  # DeepSpeed's reduce_bucket_size (elements)
    overlap_comm: Optional[bool] = None  # default: DeepSpeed's shipped JSONs (off for ZeRO-1, on for 2 and 3)
    prefetch_bucket: float = 5e7  # ZeRO-3 stage3_prefetch_bucket_size (elements)
    first_stage_layers: Optional[int] = None  # --decoder-first-pipeline-num-layers (default: an even split)
    last_stage_layers: Optional[int] = None  # --decoder-last-pipeline-num-layers

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.dp * self.cp

    @property
    def data(self) -> int:
        """DeepSpeed's data-parallel size, over which ZeRO partitions and gradients are reduced: DP x CP."""
        return self.dp * self.cp

    @property
    def overlap(self) -> bool:
        return self.zero >= 2 if self.overlap_comm is None else self.overlap_comm

    def describe(self) -> str:
        parts = [f"TP{self.tp}", f"PP{self.pp}", f"DP{self.dp}"]
        if self.cp > 1:
            parts.append(f"CP{self.cp}")
        if self.ep > 1:
            parts.append(f"EP{self.ep}")
        parts.append(f"ZeRO-{self.zero}")
        if self.sequence_parallel:
            parts.append("SP")
        if self.recompute:
            modules = "" if self.recompute != "selective" or self.recompute_modules == ("core_attn",) else \
                f"({'+'.join(self.recompute_modules)})"
            parts.append(f"rc-{self.recompute}{modules}")
        if self.offload_optimizer or self.offload_params:
            parts.append("offload-" + ("params+opt" if self.offload_params else "opt"))
        return " ".join(parts)


@dataclass
class Breakdown:
    """Per-GPU bytes on the rank that needs the most (its pipeline ``stage``): each term at its
    own largest, and ``total``, the peak over a step. Gradients, reduce buckets and activations
    do not peak at the same moment, so ``total`` is less than the sum of the terms; ``moment``
    says when it happens (the end of forward, the start of backward, or the step)."""

    parameters: float = 0.0
    gradients: float = 0.0
    optimizer: float = 0.0
    activations: float = 0.0
    logits: float = 0.0
    buffers: float = 0.0
    total: float = 0.0
    moment: str = ""
    activations_without_recompute: float = 0.0
    stage: int = 0
    params_on_rank: int = 0
    notes: list = field(default_factory=list)

    def gib(self) -> dict:
        return {k: getattr(self, k) / GIB for k in ("parameters", "gradients", "optimizer", "activations", "logits",
                                                     "buffers", "total")}


# ---------------------------------------------------------------- parameters

def layer_parameters(cfg: ModelConfig, layer: int, tp: int, ep: int) -> tuple[int, int]:
    """(dense, expert) parameters of transformer layer ``layer`` on one TP x EP rank."""
    h, d = cfg.hidden_size, cfg.kv_channels
    q, kv = cfg.num_attention_heads * d, cfg.num_query_groups * d
    bias = cfg.add_bias_linear
    dense = (h * (q + 2 * kv) + q * h) // tp + 2 * h + (bias * ((q + 2 * kv) // tp + h))
    width = 2 if cfg.swiglu else 1
    if cfg.is_moe_layer(layer):
        per_expert = (width + 1) * h * cfg.moe_ffn_hidden_size // tp
        expert = cfg.num_experts // ep * per_expert
        dense += h * cfg.num_experts  # the router, replicated
        if cfg.moe_shared_expert_intermediate_size:
            dense += (width + 1) * h * cfg.moe_shared_expert_intermediate_size // tp
        return dense, expert
    dense += (width + 1) * h * cfg.ffn_hidden_size // tp + bias * (width * cfg.ffn_hidden_size // tp + h)
    return dense, 0


def stage_layers(num_layers: int, lay: Layout) -> list[range]:
    """Transformer layers per pipeline stage, as the model splits them (``pipeline_stage_layers``: DeepSpeed's
    even split, or the layout's first and last stage counts)."""
    counts = pipeline_stage_layers(num_layers, lay.pp, lay.first_stage_layers, lay.last_stage_layers)
    starts = [sum(counts[:s]) for s in range(lay.pp)]
    return [range(starts[s], starts[s] + counts[s]) for s in range(lay.pp)]


def stage_parameters(cfg: ModelConfig, lay: Layout, stage: int) -> tuple[int, int]:
    """(dense, expert) parameters one rank of ``stage`` holds."""
    vocab = cfg.pad_vocab(lay.tp)
    embedding = vocab // lay.tp * cfg.hidden_size
    dense = expert = 0
    for layer in stage_layers(cfg.num_layers, lay)[stage]:
        d, e = layer_parameters(cfg, layer, lay.tp, lay.ep)
        dense, expert = dense + d, expert + e
    first, last = stage == 0, stage == lay.pp - 1
    if first:
        dense += embedding
        if cfg.position_embedding_type == "learned_absolute":
            dense += cfg.max_position_embeddings * cfg.hidden_size
    if last:
        dense += cfg.hidden_size  # final norm
        if cfg.untie_embeddings_and_output_weights or not first:
            dense += embedding  # the head (a tied head on a later stage is a copy of the embedding)
    return dense, expert


# ---------------------------------------------------------------- activations

def layer_activation_parts(cfg: ModelConfig, lay: Layout, backend: str = "sdpa", fused: bool = False,
                           layer: int = 0) -> tuple[float, float]:
    """Bytes autograd keeps for one transformer layer per token of a micro-batch (no recompute), as
    (the attention sub-block's, the MLP sub-block's): what selective recompute of either frees."""
    e = 2 if lay.bf16 else 4
    t = lay.tp
    h, d = cfg.hidden_size, cfg.kv_channels
    A, G = cfg.num_attention_heads * d, cfg.num_query_groups * d
    norm, residual_dropout = sub_block_edges_bytes_per_token(cfg, lay, fused)
    linear_input = e * h  # QKV's and fc1's inputs: full sequence even under SP (gathered)
    if backend == "cudnn" and G != A:
        attention = e * 5 * A / t  # q, k and v repeated to every head, the output, the projection input
    elif backend == "flash":
        attention = e * (3 * A + 2 * G) / t  # contiguous q, k, v copies, the output, the projection input
    elif backend in ("cudnn", "te"):
        attention = e * (4 * A + 3 * G) / t  # QKV output (v view), rotated q, k, output, projection input
    else:  # torch SDPA as measured on CPU: QKV output, rotated q (or the output), rotated k, projection input
        attention = e * (3 * A + 3 * G) / t
    attention += math_probabilities_bytes_per_token(cfg, lay, backend)
    f = mlp_width(cfg, layer)
    # MoE: fp32 logits, probabilities, top-k bookkeeping; the k rows of each token into and out of the
    # experts (what the all-to-all carries; full width on every TP rank, balanced routing assumed)
    router = 4 * cfg.num_experts * 3 + 2 * e * h * cfg.moe_router_topk if cfg.is_moe_layer(layer) else 0
    mlp = e * (3 if fused else 4) * f / t if cfg.swiglu else e * 2 * f / t
    attention_dropout = A / t if cfg.attention_dropout else 0
    return (norm + linear_input + attention + attention_dropout + residual_dropout,
            norm + linear_input + mlp + router + residual_dropout)


def sub_block_edges_bytes_per_token(cfg: ModelConfig, lay: Layout, fused: bool = False) -> tuple[float, float]:
    """What each sub-block keeps around its middle, per token: its norm (the fp32 input, in fp32 runs
    the input itself, and the normalised tensor with the reference kernel, the input only with the
    fused one) and its residual dropout's byte mask; both divided over TP under SP."""
    e, share = (2 if lay.bf16 else 4), (lay.tp if lay.sequence_parallel and lay.tp > 1 else 1)
    norm = (e if fused else (4 + e)) * cfg.hidden_size / share
    return norm, (cfg.hidden_size / share if cfg.hidden_dropout else 0.0)


def math_probabilities_bytes_per_token(cfg: ModelConfig, lay: Layout, backend: str) -> float:
    """SDPA's math kernel (``backend`` "math": a CPU run with attention dropout, which torch's CPU flash
    kernel cannot draw) keeps each query's row of probabilities over the sequence's keys, before and
    after dropout, and the dropout mask; the fused kernels keep none of them."""
    if backend != "math" or not cfg.attention_dropout:
        return 0.0
    e = 2 if lay.bf16 else 4
    return cfg.num_attention_heads / lay.tp * cfg.seq_length * (2 * e + 1)


def layer_backward_bytes_per_token(cfg: ModelConfig, lay: Layout, layer: int = 0, backend: str = "sdpa") -> float:
    """The largest gradients a layer's backward allocates beside its saved tensors, per token: the MLP's
    fc1 output gradient (2f wide with SwiGLU; k rows of the expert width per token in an MoE layer), or
    under the math kernel the gradients of the probabilities and of the scores."""
    e = 2 if lay.bf16 else 4
    probabilities = math_probabilities_bytes_per_token(cfg, lay, backend)
    return max(e * (2 if cfg.swiglu else 1) * mlp_width(cfg, layer) / lay.tp, probabilities * 2 * e / (2 * e + 1))


def mlp_width(cfg: ModelConfig, layer: int) -> int:
    """The MLP's hidden width per token: the FFN width, or in an MoE layer the k expert rows of each
    token plus the shared expert's."""
    if cfg.is_moe_layer(layer):
        return cfg.moe_ffn_hidden_size * cfg.moe_router_topk + (cfg.moe_shared_expert_intermediate_size or 0)
    return cfg.ffn_hidden_size


def layer_activation_bytes_per_token(cfg: ModelConfig, lay: Layout, backend: str = "sdpa",
                                     fused: bool = False, layer: int = 0) -> float:
    """Bytes autograd keeps for one transformer layer per token of a micro-batch (no recompute)."""
    return sum(layer_activation_parts(cfg, lay, backend, fused, layer))


def ring_buffer_bytes_per_token(cfg: ModelConfig, lay: Layout) -> float:
    """Ring attention's K/V in hand and arriving, per local token (only while a layer's attention runs)."""
    e = 2 if lay.bf16 else 4
    return 2 * e * 2 * cfg.num_query_groups * cfg.kv_channels / lay.tp if lay.cp > 1 else 0.0


def local_tokens(cfg: ModelConfig, lay: Layout) -> float:
    """Tokens of one micro-batch on one rank: each CP rank holds 1/CP of every sample."""
    return lay.micro_batch_size * cfg.seq_length / lay.cp


def stage_activation_bytes(cfg: ModelConfig, lay: Layout, stage: int, *, backend: str, fused: bool,
                           recompute: Optional[str]) -> float:
    """Activations of one stage's rank at their largest: all it keeps, plus what one layer rebuilds or receives."""
    kept, transient = stage_activation_parts(cfg, lay, stage, backend=backend, fused=fused, recompute=recompute)
    return kept + transient


def stage_activation_parts(cfg: ModelConfig, lay: Layout, stage: int, *, backend: str, fused: bool,
                           recompute: Optional[str]) -> tuple[float, float]:
    """(kept, transient): what one stage's rank keeps at the end of its last forward before a backward,
    and what exists only while one layer runs (the layer recompute rebuilds in backward, the ring's
    K/V blocks, the gradients its backward allocates), which the last stage's logits never meet: they
    are gone before a layer's backward."""
    e = 2 if lay.bf16 else 4
    t = lay.tp
    sp = lay.sequence_parallel and t > 1
    tokens = local_tokens(cfg, lay)
    layers = list(stage_layers(cfg.num_layers, lay)[stage])
    per_layer = [layer_activation_bytes_per_token(cfg, lay, backend, fused, n) * tokens for n in layers]
    ring = ring_buffer_bytes_per_token(cfg, lay) * tokens
    if recompute == "full":
        # each layer keeps its input (split over TP by SP, or by DeepSpeed's partitioned
        # activations otherwise); backward rebuilds one layer at a time
        kept = e * cfg.hidden_size * tokens / (t if t > 1 else 1)
        micro, rebuilding = kept * len(layers), max(per_layer, default=0.0)
    elif recompute == "selective":
        # core_attn: the attention kernel's output is rebuilt in backward instead of kept; mlp / moe: a
        # dense layer's MLP or an MoE layer's router and experts keep only the normalised input (split over
        # TP by SP) and are rebuilt
        A = cfg.num_attention_heads * cfg.kv_channels
        core = (e * A / t if backend != "flash" else 0.0) + math_probabilities_bytes_per_token(cfg, lay, backend)
        attention_output = core * tokens if "core_attn" in lay.recompute_modules else 0.0
        micro, rebuilding = 0.0, 0.0
        for n, full in zip(layers, per_layer):
            keep, rebuilt = full - attention_output, attention_output
            if ("moe" if cfg.is_moe_layer(n) else "mlp") in lay.recompute_modules:
                # the norm and the residual dropout stay outside; the checkpoint keeps the norm's output
                block = (layer_activation_parts(cfg, lay, backend, fused, n)[1]
                         - sum(sub_block_edges_bytes_per_token(cfg, lay, fused))) * tokens
                keep += e * cfg.hidden_size * tokens / (t if sp else 1) - block
                rebuilt = max(rebuilt, block)
            micro, rebuilding = micro + keep, max(rebuilding, rebuilt)
    else:
        micro, rebuilding = sum(per_layer), 0.0
    in_flight = min(lay.pp - stage, lay.grad_accum) if lay.pp > 1 else 1
    # The embedding output (the first layer's input) stays with the first layer's norm (fp32 runs) and
    # DeepSpeed's pipeline keeps each in-flight micro-batch's stage input and output.
    pipe_buffers = 2 * e * cfg.hidden_size * tokens / (t if sp else 1) if lay.pp > 1 else 0.0
    # a layer's backward allocates gradients as large as its widest activations while they are still kept
    gradients = max((layer_backward_bytes_per_token(cfg, lay, n, backend) for n in layers), default=0.0) * tokens
    return in_flight * (micro + pipe_buffers), rebuilding + ring + gradients


def logits_bytes(cfg: ModelConfig, lay: Layout) -> tuple[float, float]:
    """The output layer and the vocab-parallel cross-entropy on the last stage: (peak in forward,
    kept into backward). The head sees the full sequence (gathered under SP).

    The cross-entropy (``tensor_parallel._VocabParallelCrossEntropy``) keeps the logits themselves
    for backward and works in fp32 a chunk of rows at a time (one chunk of ``_CHUNK_ELEMENTS``
    entries alive, two in bf16): the forward holds the logits (and the chunks), the backward
    the logits and their gradient, of the logits' dtype. TP=1 with --torch-compile computes a
    compiled cross-entropy, counted here as this one."""
    from ..parallel.tensor_parallel import _CHUNK_ELEMENTS
    e = 2 if lay.bf16 else 4
    vocab = cfg.pad_vocab(lay.tp) / lay.tp
    tokens = local_tokens(cfg, lay)
    # fp32 chunks alive at once: the shifted chunk (fp32 logits are read in place), and in bf16 its fp32 copy too
    chunks = (2 if lay.bf16 else 1) * 4 * min(_CHUNK_ELEMENTS, tokens * vocab)
    forward = e  # the logits
    backward = 2 * e  # the logits, kept, and their gradient
    if lay.pp > 1:
        # DeepSpeed's pipeline engine keeps the last stage's outputs (the logits) in its buffers until
        # the buffer is reused: the current micro-batch's for backward, and the previous one's
        backward += e
        forward += e if lay.grad_accum > 1 else 0
    final_norm = (4 + 2 * e) * cfg.hidden_size  # the final norm's kept tensors
    return tokens * (vocab * forward + final_norm) + chunks, tokens * (vocab * backward + final_norm) + chunks


# ---------------------------------------------------------------- model states

@dataclass
class States:
    """Model-state bytes of one rank by when they exist within a step."""
    params: float = 0.0
    optimizer: float = 0.0  # fp32 master + Adam moments, from the first step on
    grads_kept: float = 0.0  # gradient buffers that outlive the step (alive during forward too)
    grads_end: float = 0.0  # gradients at the end of backward (replaces grads_kept then)
    buffers_kept: float = 0.0  # communication buffers alive for the whole run
    buffers_backward: float = 0.0  # allocated when backward starts, until the reduction ends
    step_extra: float = 0.0  # temporaries of the reduction and the optimizer step
    notes: list = field(default_factory=list)


def model_states(n: float, lay: Layout) -> States:
    """The bytes of ``n`` parameters on one rank under the layout's optimizer path (module docstring)."""
    dp, z = lay.data, lay.zero  # ZeRO partitions over DP x CP
    pe = 2 if lay.bf16 else 4  # parameter / gradient element
    bucket = lay.reduce_bucket
    s = States()
    if z == 0:
        if not lay.bf16:  # torch AdamW through the engine; grads set to None after each step
            s.params, s.optimizer, s.grads_end = 4 * n, 8 * n, 4 * n
            s.step_extra = 4 * min(n, bucket) if dp > 1 else 0.0  # the flat all-reduce copy
        elif lay.pp == 1:  # FP16_Optimizer (fused, bf16): fp32 master + moments, fp32 flat grads in the step
            s.params, s.optimizer, s.grads_end = 2 * n, (4 + lay.moment_bytes) * n, 2 * n
            s.step_extra = 4 * n + (2 * min(n, bucket) if dp > 1 else 0.0)
        else:  # BF16_Optimizer: master and moments partitioned over DP, fp32 accumulation kept
            s.params, s.optimizer, s.grads_kept, s.grads_end = 2 * n, (4 + lay.moment_bytes) * n / dp, 4 * n, 4 * n + 2 * n
        return s
    part = n / dp
    s.optimizer = 0.0 if lay.offload_optimizer else (4 + lay.moment_bytes) * part
    if lay.offload_optimizer:
        s.notes.append("optimizer states on the CPU")
    reduce_dtype = 4 if (z == 1 or not lay.bf16) else pe  # ZeRO-1 stages an fp32 accumulator
    if z in (1, 2):
        s.params = pe * n
        s.buffers_backward = reduce_dtype * bucket * (2 if lay.overlap else 1)
        # ZeRO-1 keeps every gradient until the reduction at the end; ZeRO-2 only its partition (fp32),
        # which the step reads in place (measured on an H200: no second fp32 copy at the step)
        s.grads_end = (pe * n + 4 * part) if z == 1 else 4 * part
    else:
        s.params = 0.0 if lay.offload_params else pe * part
        s.grads_kept = s.grads_end = 4 * part  # the flat gradient partition, allocated at start-up
        # the reduce bucket, and the copy of the last one reduce-scattered, kept until the next backward
        s.buffers_kept = reduce_dtype * (bucket + min(bucket, n))
        if lay.offload_params:
            s.notes.append("parameters on the CPU between uses")
    return s


def estimate(cfg: ModelConfig, lay: Layout, *, backend: str = "sdpa", fused: bool = False) -> Breakdown:
    """Peak bytes on the rank that needs the most. Three moments of a step are compared:
    the end of the last forward (all activations, the cross-entropy's peak), the start of
    backward (the reduce buckets appear, the softmax is still kept) and the end of backward
    (all gradients and the step's temporaries, no activations)."""
    cfg = replace(cfg, padded_vocab_size=cfg.pad_vocab(lay.tp))
    best: Optional[Breakdown] = None
    for stage in range(lay.pp):
        dense, expert = stage_parameters(cfg, lay, stage)
        s = model_states(dense, lay)
        if expert:  # ZeRO shards expert parameters over the expert-data-parallel group (DP x CP / EP)
            x = model_states(expert, replace(lay, dp=max(1, lay.data // lay.ep), cp=1))
            for name in ("params", "optimizer", "grads_kept", "grads_end", "step_extra"):
                setattr(s, name, getattr(s, name) + getattr(x, name))
        kept, transient = stage_activation_parts(cfg, lay, stage, backend=backend, fused=fused, recompute=lay.recompute)
        layer_count = len(stage_layers(cfg.num_layers, lay)[stage])
        acts = kept + transient
        plain = stage_activation_bytes(cfg, lay, stage, backend=backend, fused=fused, recompute=None)
        last = stage == lay.pp - 1
        logits_fwd, logits_bwd = logits_bytes(cfg, lay) if last else (0.0, 0.0)
        # ZeRO-3 gathers each layer's parameters for its forward and backward, prefetching up to
        # stage3_prefetch_bucket_size elements ahead: a small model is gathered whole.
        gathered = (2 if lay.bf16 else 4) * min(dense, lay.prefetch_bucket) if lay.zero == 3 else 0.0
        if lay.zero == 3 and not cfg.untie_embeddings_and_output_weights and stage == lay.pp - 1:
            # a tied head uses the embedding outside its module: ZeRO-3 keeps that weight gathered
            gathered += (2 if lay.bf16 else 4) * cfg.padded_vocab_size // lay.tp * cfg.hidden_size
        # Under 1F1B a stage runs backward passes between forwards: the step's gradients are there
        # from the first backward on, and ZeRO-1/2 reduce them only once the pipeline is drained.
        grads_fwd = max(s.grads_kept, s.grads_end) if lay.pp > 1 else s.grads_kept
        bucket_bwd = 0.0 if lay.pp > 1 else s.buffers_backward
        # A layer's transient activations (recompute, ring blocks) and the logits never coexist: the
        # head's forward and backward run before and after every layer's, not inside one.
        moments = {
            "forward": dict(gradients=grads_fwd, buffers=s.buffers_kept + gathered, activations=kept, logits=logits_fwd),
            "backward": dict(gradients=grads_fwd, buffers=s.buffers_kept + bucket_bwd + gathered, activations=kept,
                             logits=logits_bwd),
            "last layer's backward": dict(gradients=grads_fwd, buffers=s.buffers_kept + bucket_bwd + gathered,
                                          activations=kept + transient, logits=0.0),
            # the stage's first layer's backward: every other gradient exists by then, and of the kept
            # activations only that layer's are left (under PP, the other micro-batches' too)
            "first layer's backward": dict(gradients=max(s.grads_kept, s.grads_end), buffers=s.buffers_kept + bucket_bwd + gathered,
                                           activations=(kept if lay.pp > 1 else kept / max(1, layer_count)) + transient,
                                           logits=0.0),
            "step": dict(gradients=max(s.grads_kept, s.grads_end), buffers=s.buffers_kept + s.buffers_backward + s.step_extra,
                         activations=0.0, logits=0.0),
        }
        name, parts = max(moments.items(), key=lambda kv: sum(kv[1].values()))
        b = Breakdown(parameters=s.params, gradients=max(s.grads_kept, s.grads_end), optimizer=s.optimizer,
                      activations=acts, logits=logits_fwd,
                      buffers=s.buffers_kept + s.buffers_backward + max(gathered, s.step_extra),
                      total=s.params + s.optimizer + sum(parts.values()),
                      moment=name, activations_without_recompute=plain, stage=stage, params_on_rank=dense + expert,
                      notes=s.notes + [f"peak at the {name}"])
        if best is None or b.total > best.total:
            best = b
    return best


def total_parameters(cfg: ModelConfig) -> int:
    """The whole model's parameters (one copy: no TP/PP/EP split)."""
    single = Layout(tp=1, pp=1)
    dense, expert = stage_parameters(cfg, single, 0)
    return dense + expert


def ds_settings(ds: dict) -> dict:
    """The Layout fields a DeepSpeed JSON decides: ZeRO stage, bucket sizes, overlap, offload."""
    zero_json = ds.get("zero_optimization", {}) or {}

    def offloaded(what: str) -> bool:
        return (zero_json.get(f"offload_{what}") or {}).get("device") not in (None, "none")

    return dict(zero=int(zero_json.get("stage", 0) or 0), reduce_bucket=float(zero_json.get("reduce_bucket_size", 5e8)),
                overlap_comm=None if zero_json.get("overlap_comm") == "auto" else zero_json.get("overlap_comm"),  # auto: the flag, off by default
                prefetch_bucket=float(zero_json.get("stage3_prefetch_bucket_size", 5e7)),
                offload_optimizer=offloaded("optimizer"), offload_params=offloaded("param"))


def layout_from_run(cfg, ds: dict) -> Layout:
    """The Layout of a validated RunConfig and its DeepSpeed JSON (``prepare_config``'s pair)."""
    p, t = cfg.parallel, cfg.train
    return Layout(tp=p.tensor_model_parallel_size, pp=p.pipeline_model_parallel_size, dp=p.data_parallel_size,
                  ep=p.expert_model_parallel_size, cp=p.context_parallel_size, sequence_parallel=p.sequence_parallel,
                  recompute=p.recompute_granularity, recompute_modules=tuple(p.recompute_modules or ()),
                  micro_batch_size=t.micro_batch_size,
                  grad_accum=cfg.gradient_accumulation_steps, bf16=t.bf16, **ds_settings(ds),
                  first_stage_layers=p.decoder_first_pipeline_num_layers, last_stage_layers=p.decoder_last_pipeline_num_layers,
                  moment_bytes=(2 if t.exp_avg_dtype != "fp32" else 4) + (2 if t.exp_avg_sq_dtype != "fp32" else 4))
