"""The run's configuration: three typed dataclasses, filled once from the command line.

Config flows one way: flags -> ``RunConfig`` -> constructors. Every flag is a dataclass
field; its name is the field's name with dashes (Megatron's spelling), its help text is
the field's ``help`` metadata, and the README's flag table is generated from the same
fields (``python -m hybridlm.config --markdown``), so code, CLI and docs cannot drift.

``RunConfig.validate(world_size)`` checks every cross-constraint (heads divisible by TP,
world size a multiple of TP x PP, ...) *before* any process group exists, so a bad
layout ends in one sentence on every rank instead of a hang inside a collective.
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
from dataclasses import dataclass, field
from typing import Any, Optional, get_type_hints

from .presets import MODELS


class ConfigError(ValueError):
    """A bad flag, file or combination; the message is one sentence naming it."""


def _f(default, help: str, *, choices=None, aliases=(), cli: bool = True, nargs=None):
    return field(default=default, metadata={"help": help, "choices": choices, "aliases": aliases, "cli": cli, "nargs": nargs})


FUSED_OPS = ("rmsnorm", "rope", "swiglu")


@dataclass
class ModelConfig:
    """Every hyper-parameter of the network; independent of how it is parallelised."""

    model: Optional[str] = _f(None, f"Named shape from hybridlm/presets.py ({', '.join(MODELS)}); its flags come first, so flags given here (or in --config) win.")
    num_layers: int = _f(4, "Number of transformer layers.")
    hidden_size: int = _f(128, "Width of the residual stream.")
    ffn_hidden_size: Optional[int] = _f(None, "MLP inner width (default: 4*hidden, or 8/3*hidden rounded up to 64 with SwiGLU).")
    num_attention_heads: int = _f(4, "Query heads.")
    num_query_groups: Optional[int] = _f(None, "Key/value heads for grouped-query attention (default: one per query head).")
    kv_channels: Optional[int] = _f(None, "Head dimension (default: hidden / heads).")
    seq_length: int = _f(128, "Tokens per sample.")
    max_position_embeddings: Optional[int] = _f(None, "Size of the learned position table (default: seq-length).")
    vocab_size: Optional[int] = _f(None, "Tokenizer vocabulary (default: the built-in tokenizer's).")
    make_vocab_size_divisible_by: int = _f(128, "Pad the vocabulary to a multiple of this times TP (Megatron's rule).")
    normalization: str = _f("RMSNorm", "Norm layer.", choices=("RMSNorm", "LayerNorm"))
    norm_epsilon: float = _f(1e-5, "Epsilon of the norm layers.")
    position_embedding_type: str = _f("rope", "Positions: rotary (Llama) or a learned table (GPT-2).", choices=("rope", "learned_absolute"))
    rotary_base: float = _f(10000.0, "RoPE base frequency.")
    swiglu: bool = _f(True, "SwiGLU MLP (Llama); --no-swiglu gives a GeLU MLP (GPT-2).")
    add_bias_linear: bool = _f(False, "Biases in the linear layers (GPT-2 style).", aliases=("--disable-bias-linear",))
    add_qkv_bias: bool = _f(False, "Biases in the query/key/value projection only (Qwen2 style).")
    untie_embeddings_and_output_weights: bool = _f(False, "Separate input embedding and output projection.")
    hidden_dropout: float = _f(0.0, "Dropout on the residual branches.")
    attention_dropout: float = _f(0.0, "Dropout on the attention probabilities.")
    init_method_std: float = _f(0.02, "Std of the normal initialisation (output projections scaled by 1/sqrt(2*layers)).")
    attention_backend: str = _f("auto", "Attention kernel: auto picks flash-attn when importable, else cuDNN SDPA on Hopper, else torch SDPA.",
                                choices=("auto", "flash", "te", "cudnn", "sdpa"))
    transformer_impl: str = _f("local", "Linear layers from this project, or from Transformer Engine (needed for FP8).", choices=("local", "transformer_engine"))
    fp8_format: Optional[str] = _f(None, "FP8 matmuls through Transformer Engine: hybrid (E4M3 forward, E5M2 gradients) or e4m3 (default: off).", choices=("hybrid", "e4m3"))
    fp8_recipe: str = _f("delayed", "FP8 scaling: delayed (amax history) or current (per-tensor, this step's amax).", choices=("delayed", "current"))
    fp8_amax_history_len: int = _f(1024, "Delayed scaling: steps of amax history.")
    fused_ops: str = _f("auto", "Fused kernels built through DeepSpeed's op builder: auto (each where it beats torch.compile on this device), all, none, or a comma list of rmsnorm,rope,swiglu.")
    require_fused_ops: bool = _f(False, "Stop when a requested fused kernel cannot be built, instead of falling back to PyTorch.")
    torch_compile: bool = _f(False, "torch.compile each transformer layer, and the cross-entropy with TP=1 (fuses norms, RoPE, SwiGLU and residuals; the first steps pay the compile).")
    cuda_graphs: bool = _f(False, "Capture each transformer layer's forward and backward as CUDA graphs (Transformer Engine's make_graphed_callables) and replay them in training, for runs whose GPU waits on Python; TP=1, no PP, MoE, recompute, dropout or ZeRO-3 yet.",
                           aliases=("--external-cuda-graph",))
    gradient_accumulation_fusion: bool = _f(False, "Let Transformer Engine's weight-gradient GEMMs add each micro-batch's product into the accumulated gradients (Megatron's flag) instead of a separate addition per parameter; needs --transformer-impl transformer_engine, ZeRO 0 or 1 and no PP.")
    num_experts: Optional[int] = _f(None, "Mixture-of-Experts: routed experts per MoE layer (default: a dense model).")
    moe_layer_freq: int = _f(1, "MoE in every k-th layer (layers 0, k, 2k, ...); the others keep the dense MLP.")
    moe_ffn_hidden_size: Optional[int] = _f(None, "Inner width of each expert (default: --ffn-hidden-size).")
    moe_router_topk: int = _f(2, "Experts each token is routed to (softmax over the chosen experts' logits, as Mixtral).")
    moe_aux_loss_coeff: float = _f(1e-2, "Weight of the load-balancing loss (Switch/GShard: E x sum of token fraction x mean probability).")
    moe_z_loss_coeff: float = _f(0.0, "Weight of the router z-loss (mean squared log-sum-exp of the router logits).")
    moe_capacity_factor: Optional[float] = _f(None, "Expert capacity as a multiple of an even share of the assignments; each expert keeps first choices before second ones, earlier tokens first, and drops the rest (default: dropless).")
    moe_shared_expert_intermediate_size: Optional[int] = _f(None, "Width of a shared expert every token also goes through (default: none).")
    moe_grouped_gemm: bool = _f(True, "Compute the experts as one grouped GEMM (torch.nn.functional.grouped_mm) where torch offers it; else a loop over experts.")
    padded_vocab_size: Optional[int] = _f(None, "Derived: vocabulary padded for TP.", cli=False)

    def __post_init__(self):
        if self.num_query_groups is None:
            self.num_query_groups = self.num_attention_heads
        if self.kv_channels is None:
            if self.hidden_size % self.num_attention_heads:
                raise ConfigError(f"--hidden-size {self.hidden_size} is not divisible by --num-attention-heads {self.num_attention_heads}.")
            self.kv_channels = self.hidden_size // self.num_attention_heads
        if self.ffn_hidden_size is None:
            self.ffn_hidden_size = 64 * math.ceil(8 * self.hidden_size / 3 / 64) if self.swiglu else 4 * self.hidden_size
        if self.max_position_embeddings is None:
            self.max_position_embeddings = self.seq_length
        if self.num_attention_heads % self.num_query_groups:
            raise ConfigError(f"--num-attention-heads {self.num_attention_heads} is not divisible by --num-query-groups {self.num_query_groups}.")
        if self.seq_length > self.max_position_embeddings and self.position_embedding_type == "learned_absolute":
            raise ConfigError(f"--seq-length {self.seq_length} exceeds --max-position-embeddings {self.max_position_embeddings}.")
        for name in ("num_layers", "hidden_size", "num_attention_heads", "seq_length"):
            if getattr(self, name) < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be positive, got {getattr(self, name)}.")
        if self.num_experts is not None:
            self._check_moe()
        self.fused_op_names()  # refuses an unknown name now, not at model build

    @property
    def graphed_attention_shape(self) -> Optional[tuple[int, int]]:
        """(head dim, sequence length) when the layers are captured as CUDA graphs, for the attention backend's choice."""
        return (self.kv_channels, self.seq_length) if self.cuda_graphs else None

    def fused_op_names(self) -> Optional[tuple[str, ...]]:
        """--fused-ops as names of kernels; None means "auto" (each op's own default for the device).
        With --torch-compile, auto means none: inductor fuses these elementwise chains itself, and
        an opaque custom op in the middle would only cut the fusion."""
        if self.fused_ops == "auto":
            return () if self.torch_compile else None
        if self.fused_ops in ("all", "none"):
            return FUSED_OPS if self.fused_ops == "all" else ()
        names = tuple(n.strip() for n in self.fused_ops.split(",") if n.strip())
        unknown = [n for n in names if n not in FUSED_OPS]
        if unknown:
            raise ConfigError(f"--fused-ops {self.fused_ops}: unknown kernel {unknown[0]!r} (have: auto, all, none, {', '.join(FUSED_OPS)}).")
        return names

    def _check_moe(self):
        if self.num_experts < 1:
            raise ConfigError(f"--num-experts must be positive, got {self.num_experts}.")
        if not 1 <= self.moe_router_topk <= self.num_experts:
            raise ConfigError(f"--moe-router-topk {self.moe_router_topk} must be between 1 and --num-experts {self.num_experts}.")
        if self.moe_layer_freq < 1:
            raise ConfigError(f"--moe-layer-freq must be positive, got {self.moe_layer_freq}.")
        if self.moe_capacity_factor is not None and self.moe_capacity_factor <= 0:
            raise ConfigError(f"--moe-capacity-factor must be positive, got {self.moe_capacity_factor}.")
        if self.add_bias_linear:
            raise ConfigError("--num-experts cannot be combined with --add-bias-linear: experts have no biases (as in Mixtral).")
        if self.moe_ffn_hidden_size is None:
            self.moe_ffn_hidden_size = self.ffn_hidden_size

    def is_moe_layer(self, layer_number: int) -> bool:
        """Whether 0-based layer ``layer_number`` has experts instead of the dense MLP (Megatron's rule)."""
        return self.num_experts is not None and layer_number % self.moe_layer_freq == 0

    def pad_vocab(self, tensor_parallel: int) -> int:
        multiple = self.make_vocab_size_divisible_by * tensor_parallel
        return multiple * math.ceil(self.vocab_size / multiple)


@dataclass
class ParallelConfig:
    """How the model is laid out over ranks. DP is whatever the world leaves over."""

    tensor_model_parallel_size: int = _f(1, "TP: ranks that split each weight matrix.")
    pipeline_model_parallel_size: int = _f(1, "PP: pipeline stages (DeepSpeed's 1F1B engine when > 1).")
    expert_model_parallel_size: int = _f(1, "EP: ranks that split the experts (carved out of DP).")
    sequence_parallel: bool = _f(False, "Megatron sequence parallelism: shard norms/dropout activations over TP.")
    recompute_granularity: Optional[str] = _f(None, "Activation recompute: whole layers or only core attention.", choices=("full", "selective"))
    recompute_num_layers: Optional[int] = _f(None, "With full recompute: recompute the first N layers of each stage (default: all).")
    partition_activations: Optional[bool] = _f(None, "Split checkpointed activations over TP (default: on with TP>1 and full recompute, off with SP).")
    zero_stage: int = _f(0, "Derived from the DeepSpeed JSON.", cli=False)
    data_parallel_size: int = _f(1, "Derived: world / (TP x PP).", cli=False)


@dataclass
class TrainConfig:
    """The optimisation run: batches, schedule, precision, I/O."""

    deepspeed_config: str = _f("ds_configs/zero1.json", "DeepSpeed JSON; its 'auto' values are filled from these flags.", aliases=("--deepspeed-config",))
    micro_batch_size: int = _f(8, "Samples per rank per micro-step.")
    global_batch_size: Optional[int] = _f(None, "Samples per optimizer step over all DP ranks (default: micro x DP).")
    train_iters: int = _f(300, "Optimizer steps.")
    lr: float = _f(3e-3, "Peak learning rate.")
    min_lr: float = _f(3e-4, "Learning rate at the end of the decay.")
    lr_warmup_iters: int = _f(20, "Linear warm-up steps.")
    eval_interval: Optional[int] = _f(None, "Evaluate on the validation split every N steps (and at the end).")
    eval_iters: int = _f(10, "Global batches per evaluation (the same first batches of the validation split each time).")
    lr_decay_iters: Optional[int] = _f(None, "Steps of decay after warm-up (default: train-iters).")
    lr_decay_style: str = _f("cosine", "Decay after warm-up (wsd: constant, then a final decay).", choices=("cosine", "linear", "constant", "wsd"))
    lr_wsd_decay_iters: Optional[int] = _f(None, "WSD: steps of the final decay (default: 10% of --lr-decay-iters).")
    lr_wsd_decay_style: str = _f("linear", "WSD: shape of the final decay.", choices=("linear", "cosine", "exponential", "minus_sqrt"))
    weight_decay: float = _f(0.1, "AdamW weight decay (not applied to norms and biases).")
    adam_beta1: float = _f(0.9, "AdamW beta1.")
    adam_beta2: float = _f(0.95, "AdamW beta2.")
    adam_eps: float = _f(1e-8, "AdamW epsilon.")
    clip_grad: float = _f(1.0, "Global gradient-norm clip (0 disables).")
    optimizer_impl: str = _f("auto", "AdamW implementation: torch (fused on GPU), DeepSpeed's CPU Adam for offload, or auto.", choices=("auto", "torch", "deepspeed_cpu"))
    seed: int = _f(1234, "Seed of initialisation, data order and dropout; the same seed gives the same model at any layout.")
    bf16: bool = _f(False, "bfloat16 training (fp32 master weights in the optimizer).")
    fp16: bool = _f(False, "float16 training with dynamic loss scaling.")
    save: Optional[str] = _f(None, "Directory to save checkpoints to.")
    save_interval: Optional[int] = _f(None, "Save every N steps (default: only at the end).")
    keep_last_n_checkpoints: Optional[int] = _f(None, "Delete older checkpoints, keeping this many (default: keep all).")
    load: Optional[str] = _f(None, "Directory to resume from (its latest complete checkpoint).")
    ckpt_step: Optional[int] = _f(None, "With --load: resume from global_step<N> instead of the latest.")
    finetune: bool = _f(False, "With --load: take only the model weights; fresh optimizer, LR schedule and iteration count (Megatron's --finetune).")
    exit_signal_handler: bool = _f(False, "On --exit-signal finish the step, save a checkpoint on every rank and exit with code 75 (the sbatch templates requeue the job on it).")
    exit_signal: str = _f("SIGUSR1", "The signal --exit-signal-handler acts on (Slurm: #SBATCH --signal=USR1@120).", choices=("SIGUSR1", "SIGUSR2", "SIGTERM", "SIGINT"))
    max_bad_steps: int = _f(5, "Stop after this many consecutive skipped (overflowing or non-finite) steps; 0 never stops.")
    log_interval: int = _f(10, "Log every N steps.")
    metrics_file: Optional[str] = _f(None, "JSON-lines file: one record per logged step.")
    peak_tflops: Optional[float] = _f(None, "Peak TFLOP/s per device for MFU (default: the GPU's datasheet bf16 dense peak).")
    nvme_path: Optional[str] = _f(None, "Folder for ZeRO-Infinity swap files (fills 'auto' nvme_path in the JSON).")
    distributed_timeout_minutes: float = _f(10.0, "Collective timeout: a dead rank brings the others down after this long.")
    wandb_project: Optional[str] = _f(None, "Weights & Biases project: rank 0 logs every logged step there (WANDB_MODE=offline keeps it on disk).")
    wandb_name: Optional[str] = _f(None, "W&B run name (default: W&B's generated one).")
    wandb_dir: Optional[str] = _f(None, "Folder for W&B's local files (default: --save, else the working directory).")
    tensorboard_dir: Optional[str] = _f(None, "Write TensorBoard scalars (rank 0) to this folder.")
    profile_step_range: Optional[str] = _f(None, "Profile iterations A+1..B with torch.profiler, given as A,B; one Chrome trace per rank.")
    profile_dir: str = _f("profile", "Folder for the --profile-step-range traces.")
    manual_gc: bool = _f(False, "Turn Python's automatic garbage collector off and collect at fixed steps instead (same step on every rank; Megatron's flag).")
    manual_gc_interval: int = _f(0, "With --manual-gc: collect every N steps (0: only around evaluation).")


@dataclass
class DataConfig:
    """Where samples come from: Megatron-format .bin/.idx prefixes and their tokenizer."""

    data_path: Optional[list] = _f(None, "Data prefixes, optionally weighted ('0.3 a 0.7 b'); default: the built-in corpus.", nargs="+")
    split: str = _f("969,30,1", "Train/validation/test proportions of each prefix's documents.")
    tokenizer_type: str = _f("ByteTokenizer", "Tokenizer the data was preprocessed with.",
                             choices=("ByteTokenizer", "HuggingFaceTokenizer", "GPT2BPETokenizer"))
    tokenizer_model: Optional[str] = _f(None, "HuggingFaceTokenizer: a tokenizer.json file or a local tokenizer directory.")
    vocab_file: Optional[str] = _f(None, "GPT2BPETokenizer: vocab.json.")
    merge_file: Optional[str] = _f(None, "GPT2BPETokenizer: merges.txt.")
    data_cache_path: Optional[str] = _f(None, "Folder for the sample-index caches (default: index-cache/ beside each prefix).")


@dataclass
class RunConfig:
    model: ModelConfig
    parallel: ParallelConfig
    train: TrainConfig
    data: DataConfig = field(default_factory=DataConfig)
    explicit: frozenset = frozenset()  # flags the user typed (so a JSON value can win over a default)

    @property
    def gradient_accumulation_steps(self) -> int:
        return self.train.global_batch_size // (self.train.micro_batch_size * self.parallel.data_parallel_size)

    def validate(self, world_size: int) -> "RunConfig":
        """Check the layout against the world and fill derived fields. Pure: no process groups."""
        m, p, t = self.model, self.parallel, self.train
        tp, pp, ep = p.tensor_model_parallel_size, p.pipeline_model_parallel_size, p.expert_model_parallel_size
        for flag, v in (("--tensor-model-parallel-size", tp), ("--pipeline-model-parallel-size", pp), ("--expert-model-parallel-size", ep)):
            if v < 1:
                raise ConfigError(f"{flag} must be at least 1, got {v}.")
        if world_size % (tp * pp):
            raise ConfigError(f"world size {world_size} is not a multiple of TP x PP = {tp} x {pp}; it must equal TP x PP x DP.")
        p.data_parallel_size = world_size // (tp * pp)
        if m.num_attention_heads % tp:
            raise ConfigError(f"--num-attention-heads {m.num_attention_heads} is not divisible by --tensor-model-parallel-size {tp}.")
        if m.num_query_groups % tp:
            raise ConfigError(f"--num-query-groups {m.num_query_groups} is not divisible by --tensor-model-parallel-size {tp}.")
        if m.ffn_hidden_size % tp:
            raise ConfigError(f"--ffn-hidden-size {m.ffn_hidden_size} is not divisible by --tensor-model-parallel-size {tp}.")
        if pp > m.num_layers:
            raise ConfigError(f"--pipeline-model-parallel-size {pp} exceeds --num-layers {m.num_layers}: every stage needs a layer.")
        if ep > 1 and m.num_experts is None:
            raise ConfigError(f"--expert-model-parallel-size {ep} needs --num-experts: a dense model has no experts to split.")
        if p.data_parallel_size % ep:
            raise ConfigError(f"--expert-model-parallel-size {ep} does not divide the data-parallel size {p.data_parallel_size} "
                              f"(world {world_size} / (TP x PP) = {p.data_parallel_size}); EP is carved out of DP.")
        if m.num_experts is not None:
            self._check_moe_layout(tp, ep)
        if p.sequence_parallel and tp == 1:
            p.sequence_parallel = False  # nothing to shard over; Megatron does the same
        if p.sequence_parallel and m.seq_length % tp:
            raise ConfigError(f"--seq-length {m.seq_length} is not divisible by --tensor-model-parallel-size {tp}, which --sequence-parallel needs.")
        if p.recompute_num_layers is not None and p.recompute_granularity != "full":
            raise ConfigError("--recompute-num-layers needs --recompute-granularity full.")
        if p.partition_activations is None:
            p.partition_activations = tp > 1 and p.recompute_granularity == "full" and not p.sequence_parallel
        elif p.partition_activations and p.sequence_parallel:
            raise ConfigError("--partition-activations cannot be combined with --sequence-parallel: activations already differ across TP ranks.")
        if p.zero_stage >= 2 and pp > 1:
            raise ConfigError(f"ZeRO stage {p.zero_stage} (from {t.deepspeed_config}) cannot be combined with --pipeline-model-parallel-size {pp}: DeepSpeed's pipeline engine supports ZeRO 0 and 1 only.")
        if t.bf16 and t.fp16:
            raise ConfigError("--bf16 and --fp16 are mutually exclusive.")
        if m.fp8_format and m.transformer_impl != "transformer_engine":
            raise ConfigError(f"--fp8-format {m.fp8_format} needs --transformer-impl transformer_engine: FP8 matmuls come from Transformer Engine.")
        if m.torch_compile and ep > 1:
            raise ConfigError(f"--torch-compile cannot be combined with --expert-model-parallel-size {ep} yet: the expert "
                              "all-to-all has not been checked inside compiled layers on NCCL; compile works with EP=1 under TP, DP, PP and ZeRO.")
        if m.cuda_graphs:
            self._check_cuda_graphs(tp, pp)
        if m.gradient_accumulation_fusion:
            self._check_gradient_accumulation_fusion(pp)
        if m.fp8_format and not t.bf16:
            raise ConfigError(f"--fp8-format {m.fp8_format} needs --bf16: FP8 runs inside a bf16 model.")
        if t.micro_batch_size < 1:
            raise ConfigError(f"--micro-batch-size must be positive, got {t.micro_batch_size}.")
        per_step = t.micro_batch_size * p.data_parallel_size
        if t.global_batch_size is None:
            t.global_batch_size = per_step
        if t.global_batch_size % per_step:
            raise ConfigError(f"--global-batch-size {t.global_batch_size} is not divisible by --micro-batch-size x DP = {t.micro_batch_size} x {p.data_parallel_size}.")
        if t.train_iters < 1:
            raise ConfigError(f"--train-iters must be positive, got {t.train_iters}.")
        if t.lr_decay_iters is None:
            t.lr_decay_iters = t.train_iters
        if t.lr_decay_style == "wsd" and t.lr_wsd_decay_iters is None:
            t.lr_wsd_decay_iters = max(1, t.lr_decay_iters // 10)
        if t.keep_last_n_checkpoints is not None and t.keep_last_n_checkpoints < 1:
            raise ConfigError(f"--keep-last-n-checkpoints must be at least 1, got {t.keep_last_n_checkpoints}.")
        if t.eval_interval is not None and (t.eval_interval < 1 or t.eval_iters < 1):
            raise ConfigError(f"--eval-interval {t.eval_interval} and --eval-iters {t.eval_iters} must be positive.")
        if t.ckpt_step is not None and not t.load:
            raise ConfigError("--ckpt-step needs --load.")
        if t.finetune and not t.load:
            raise ConfigError("--finetune needs --load: it says what to take from the loaded checkpoint.")
        if t.manual_gc_interval < 0 or (t.manual_gc_interval and not t.manual_gc):
            raise ConfigError(f"--manual-gc-interval {t.manual_gc_interval} needs --manual-gc and must not be negative.")
        if t.exit_signal_handler and not t.save:
            raise ConfigError("--exit-signal-handler needs --save: the checkpoint it writes on the signal has to go somewhere.")
        if m.vocab_size is not None:
            m.padded_vocab_size = m.pad_vocab(tp)
        return self

    def _check_cuda_graphs(self, tp: int, pp: int) -> None:
        """What a captured layer cannot replay, or has not been checked with (one refusal each)."""
        m, p = self.model, self.parallel
        _refuse_first("--cuda-graphs", (
            (pp > 1, f"--pipeline-model-parallel-size {pp}: the pipeline engine runs its own micro-batch schedule"),
            (tp > 1, f"--tensor-model-parallel-size {tp}: TP collectives inside captured graphs have not been checked yet"),
            (m.num_experts is not None, "--num-experts: routing sends each expert a different number of tokens every micro-batch"),
            (p.recompute_granularity is not None, f"--recompute-granularity {p.recompute_granularity}: recompute re-enters the layer in backward"),
            (m.hidden_dropout > 0 or m.attention_dropout > 0, "dropout: its RNG tracker swaps generator states, which a replay would not"),
            (p.zero_stage == 3, f"ZeRO stage 3 (from {self.train.deepspeed_config}): it gathers parameters in module hooks"),
        ))

    def _check_gradient_accumulation_fusion(self, pp: int) -> None:
        m, p = self.model, self.parallel
        _refuse_first("--gradient-accumulation-fusion", (
            (m.transformer_impl != "transformer_engine", "--transformer-impl local: only Transformer Engine's GEMMs accumulate into the gradients"),
            (p.zero_stage >= 2, f"ZeRO stage {p.zero_stage} (from {self.train.deepspeed_config}): it takes each micro-batch's gradients and accumulates them itself"),
            (pp > 1, f"--pipeline-model-parallel-size {pp}: the pipeline engine's micro-batch loop has not been checked with it"),
        ))

    def _check_moe_layout(self, tp: int, ep: int) -> None:
        m = self.model
        if m.num_experts % ep:
            raise ConfigError(f"--num-experts {m.num_experts} is not divisible by --expert-model-parallel-size {ep}: every EP rank holds the same number of experts.")
        if m.moe_ffn_hidden_size % tp:
            raise ConfigError(f"--moe-ffn-hidden-size {m.moe_ffn_hidden_size} is not divisible by --tensor-model-parallel-size {tp}: experts are split over TP.")
        if m.moe_shared_expert_intermediate_size and m.moe_shared_expert_intermediate_size % tp:
            raise ConfigError(f"--moe-shared-expert-intermediate-size {m.moe_shared_expert_intermediate_size} is not divisible by --tensor-model-parallel-size {tp}.")
        if self.train.fp16:
            raise ConfigError("--num-experts cannot be combined with --fp16: the aux-loss gradient does not follow fp16's dynamic loss scale; use --bf16.")
        if self.parallel.zero_stage == 3:
            raise ConfigError(f"--num-experts cannot be combined with ZeRO stage 3 (from {self.train.deepspeed_config}): "
                              "DeepSpeed's expert parameter groups support ZeRO 0, 1 and 2 only.")

    def to_dict(self) -> dict:
        return {name: dataclasses.asdict(getattr(self, name)) for name, _ in _SECTIONS}


# ---------------------------------------------------------------- command line

_SECTIONS = (("model", ModelConfig), ("parallel", ParallelConfig), ("train", TrainConfig), ("data", DataConfig))


def _cli_fields():
    for section, cls in _SECTIONS:
        hints = get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if f.metadata.get("cli", True):
                yield section, f, hints[f.name]


def _base_type(hint):
    args = getattr(hint, "__args__", None)
    return next(a for a in args if a is not type(None)) if args else hint


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description="Train a GPT with tensor/sequence/pipeline/data parallelism on DeepSpeed.",
                                     allow_abbrev=False)
    for section, f, hint in _cli_fields():
        flag = "--" + f.name.replace("_", "-")
        typ = _base_type(hint)
        kw: dict[str, Any] = dict(dest=f.name, help=f.metadata["help"], default=argparse.SUPPRESS)
        if typ is bool:
            kw["action"] = argparse.BooleanOptionalAction
        elif f.metadata["nargs"]:
            kw["nargs"], kw["type"] = f.metadata["nargs"], str
        else:
            kw["type"] = typ
            if f.metadata["choices"]:
                kw["choices"] = f.metadata["choices"]
        names = [flag]
        if f.name == "deepspeed_config":
            names = ["--deepspeed_config", "--deepspeed-config"]
        parser.add_argument(*names, **kw)
    # Megatron's negative spelling of the bias flag.
    parser.add_argument("--disable-bias-linear", dest="add_bias_linear", action="store_false", default=argparse.SUPPRESS,
                        help="No biases in linear layers (the default).")
    parser.add_argument("--config", default=None, metavar="RUN.yaml",
                        help="YAML file with the same keys as the flags (dashes or underscores); flags win over it.")
    # Megatron-DeepSpeed scripts pass --deepspeed; DeepSpeed is always on here.
    parser.add_argument("--deepspeed", action="store_true", help=argparse.SUPPRESS)
    # The deepspeed launcher appends --local_rank; the rank is read from the environment instead.
    parser.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    return parser


def parse_args(argv: Optional[list[str]] = None) -> RunConfig:
    """Flags (over ``--config`` YAML) -> RunConfig. Unknown or malformed flags end in argparse's
    one-line error (exit 2); a bad YAML file in a ConfigError naming it."""
    ns = vars(build_parser().parse_args(argv))
    ns.pop("local_rank", None)
    ns.pop("deepspeed", None)
    path = ns.pop("config", None)
    values = load_yaml(path) if path else {}
    values.update(ns)
    if values.get("model") is not None:  # the preset under the run file under the flags
        values = {**_preset_values(values["model"]), **values}
    return config_from_dict(values)


def _preset_values(name: str) -> dict:
    """A preset's flags parsed as the user's would be."""
    if name not in MODELS:
        raise ConfigError(f"--model {name}: unknown preset; the presets are {', '.join(MODELS)}.")
    values = vars(build_parser().parse_args(MODELS[name]))
    for launcher_only in ("config", "local_rank", "deepspeed"):
        values.pop(launcher_only, None)
    return values


def _cli_types() -> dict[str, type]:
    return {f.name: _base_type(hint) for _, f, hint in _cli_fields()}


def load_yaml(path: str) -> dict:
    """A run file: {flag name (dashes or underscores): value}, each value checked against the flag's type."""
    import yaml
    if not os.path.isfile(path):
        raise ConfigError(f"--config {path}: no such file.")
    try:
        with open(path) as f:
            raw = yaml.safe_load(f) or {}
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark else ""
        raise ConfigError(f"--config {path}: invalid YAML{where}: {getattr(e, 'problem', e)}.") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"--config {path}: the top level must be a mapping of flag names to values.")
    types, values = _cli_types(), {}
    for key, value in raw.items():
        name = str(key).lstrip("-").replace("-", "_")
        if name not in types:
            raise ConfigError(f"--config {path}: unknown setting '{key}'.")
        typ = types[name]
        if typ is list and isinstance(value, str):
            value = value.split()
        if value is not None and not isinstance(value, typ) and not (typ is float and isinstance(value, int)):
            try:
                value = typ(value) if typ is not bool else {"true": True, "false": False}[str(value).lower()]
            except (ValueError, KeyError):
                kind = {int: "an integer", float: "a number", bool: "true or false"}.get(typ, "a string")
                raise ConfigError(f"--config {path}: '{key}' should be {kind}, got {value!r}.") from None
        values[name] = value
    return values


def effective_yaml(cfg: RunConfig) -> str:
    """The run's settings as a --config file that reproduces it."""
    import yaml
    flat = {}
    for section, f, _ in _cli_fields():
        flat[f.name.replace("_", "-")] = getattr(getattr(cfg, section), f.name)
    return yaml.safe_dump(flat, sort_keys=False)


def config_from_dict(values: dict) -> RunConfig:
    """Flat {field: value} (as the flags give) -> RunConfig; missing fields keep their defaults."""
    by_section: dict[str, dict] = {s: {} for s, _ in _SECTIONS}
    known = {}
    for section, cls in _SECTIONS:
        for f in dataclasses.fields(cls):
            known[f.name] = section
    for k, v in values.items():
        if k not in known:
            raise ConfigError(f"unknown setting '{k}'.")
        by_section[known[k]][k] = v
    return RunConfig(model=ModelConfig(**by_section["model"]), parallel=ParallelConfig(**by_section["parallel"]),
                     train=TrainConfig(**by_section["train"]), data=DataConfig(**by_section["data"]), explicit=frozenset(values))


def world_size_from_env() -> int:
    """The world size the launcher announced (torchrun/deepspeed: WORLD_SIZE; mpirun: OMPI/PMI), else 1."""
    for var in ("WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "SLURM_NTASKS"):
        if os.environ.get(var, "").isdigit():
            return int(os.environ[var])
    return 1


def _refuse_first(flag: str, cases) -> None:
    """One sentence for the first (is_bad, why) case that holds: "<flag> cannot be combined with <why>."."""
    why = next((why for bad, why in cases if bad), None)
    if why:
        raise ConfigError(f"{flag} cannot be combined with {why}.")


def flags_markdown() -> str:
    """The README's flag table, generated from the dataclasses."""
    rows = ["| flag | default | meaning |", "|---|---|---|"]
    for _, f, hint in _cli_fields():
        flag = "--" + f.name.replace("_", "-")
        if _base_type(hint) is bool:
            flag += " / --no-" + f.name.replace("_", "-")
        choices = f" ({' / '.join(f.metadata['choices'])})" if f.metadata["choices"] else ""
        rows.append(f"| `{flag}` | `{f.default}` | {f.metadata['help']}{choices} |")
    return "\n".join(rows)


if __name__ == "__main__":
    if "--markdown" in sys.argv:
        print(flags_markdown())
