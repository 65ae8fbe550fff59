"""ModelConfig: every hyper-parameter of the network, validated in ``__post_init__``."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from ..presets import MODELS
from .fields import ConfigError, flag

FUSED_OPS = ("rmsnorm", "rope", "swiglu")
LOAD_BALANCING_TYPES = ("aux_loss", "seq_aux_loss", "global_aux_loss", "none")
SCORE_FUNCTIONS = ("softmax", "sigmoid", "sqrtsoftplus")
DROP_POLICIES = ("probs", "position", "choice_then_position")
LORA_TARGETS = ("qkv", "proj", "fc1", "fc2")  # attention's QKV and output projection, the MLP's two linears
QUANT_BLOCK = 64  # weights sharing one scale in a 4-bit base: bitsandbytes' default, which transformers' BitsAndBytesConfig uses


@dataclass
class ModelConfig:
    """Every hyper-parameter of the network; independent of how it is parallelised."""

    model: Optional[str] = flag(None, f"Named shape from hybridlm/presets.py ({', '.join(MODELS)}); its flags come first, so flags given here (or in --config) win (default: tiny, the built-in Llama-style run, when no --num-layers, --hidden-size or --num-attention-heads is given; otherwise flags left out take Megatron-LM's defaults).")
    num_layers: int = flag(4, "Number of transformer layers.")
    hidden_size: int = flag(128, "Width of the residual stream.")
    ffn_hidden_size: Optional[int] = flag(None, "MLP inner width (default: 4*hidden, or 8/3*hidden rounded down to a multiple of 64 with SwiGLU, Megatron's rule).")
    num_attention_heads: int = flag(4, "Query heads.")
    group_query_attention: bool = flag(False, "Grouped-query attention: --num-query-groups takes effect only with this flag (Megatron's rule).")
    num_query_groups: Optional[int] = flag(None, "Key/value heads with --group-query-attention (default, and always without it: one per query head).")
    kv_channels: Optional[int] = flag(None, "Head dimension (default: hidden / heads).")
    seq_length: int = flag(128, "Tokens per sample.")
    max_position_embeddings: Optional[int] = flag(None, "Size of the learned position table (default: seq-length).")
    vocab_size: Optional[int] = flag(None, "Tokenizer vocabulary (default: the built-in tokenizer's).")
    make_vocab_size_divisible_by: int = flag(128, "Pad the vocabulary to a multiple of this times TP (Megatron's rule).")
    normalization: str = flag("LayerNorm", "Norm layer.", choices=("LayerNorm", "RMSNorm"))
    norm_epsilon: float = flag(1e-5, "Epsilon of the norm layers.")
    apply_layernorm_1p: bool = flag(False, "Zero-centred norm gains: a norm's weight g (initialised at 0) scales by 1 + g (Megatron's flag).")
    position_embedding_type: str = flag("learned_absolute", "Positions: a learned table (GPT-2) or rotary (Llama).", choices=("learned_absolute", "rope"))
    rotary_base: float = flag(10000.0, "RoPE base frequency.")
    rotary_percent: float = flag(1.0, "Share of the head dimension RoPE rotates; hybridlm rotates all of it (only 1.0).")
    swiglu: bool = flag(False, "SwiGLU MLP (Llama); without it a GeLU MLP (GPT-2; the tanh GeLU, as Transformer Engine's).")
    add_bias_linear: bool = flag(True, "Biases in the linear layers (GPT-2 style); --disable-bias-linear removes them (Llama).")
    add_qkv_bias: bool = flag(False, "Biases in the query/key/value projection only (Qwen2 style).")
    untie_embeddings_and_output_weights: bool = flag(False, "Separate input embedding and output projection.")
    hidden_dropout: float = flag(0.1, "Dropout on the residual branches.")
    attention_dropout: float = flag(0.1, "Dropout on the attention probabilities.")
    init_method_std: float = flag(0.02, "Std of the normal initialisation (output projections scaled by 1/sqrt(2*layers)).")
    attention_backend: str = flag("auto", "Attention kernel: auto picks flash-attn when importable, else cuDNN SDPA on Hopper, else torch SDPA.",
                                choices=("auto", "flash", "te", "cudnn", "sdpa"))
    transformer_impl: Optional[str] = flag(None, "Linear layers from this project, or from Transformer Engine (needed for FP8) (default: transformer_engine with --fp8-format, else local).", choices=("local", "transformer_engine"))
    fp8_format: Optional[str] = flag(None, "FP8 matmuls through Transformer Engine: hybrid (E4M3 forward, E5M2 gradients) or e4m3 (default: off).", choices=("hybrid", "e4m3"))
    fp8_recipe: str = flag("delayed", "FP8 scaling: delayed (amax history) or current (per-tensor, this step's amax; Megatron's tensorwise).", choices=("delayed", "current"))
    fp8_amax_history_len: int = flag(1, "Delayed scaling: steps of amax history (Transformer Engine's DelayedScaling).")
    fp8_amax_compute_algo: str = flag("most_recent", "Delayed scaling: the amax a scale comes from, the newest or the largest in the history.", choices=("most_recent", "max"))
    fp8_param_gather: bool = flag(False, "Megatron keeps FP8 primary weights and all-gathers them in FP8; here the GEMMs get the FP8 weights cast from bf16 each step, so it only costs bf16 memory and traffic.")
    fused_ops: str = flag("auto", "Fused kernels built through DeepSpeed's op builder: auto (each where it beats torch.compile on this device), all, none, or a comma list of rmsnorm,rope,swiglu.")
    require_fused_ops: bool = flag(False, "Stop when a requested fused kernel cannot be built, instead of falling back to PyTorch.")
    torch_compile: bool = flag(False, "torch.compile each transformer layer, and the cross-entropy with TP=1 (fuses norms, RoPE, SwiGLU and residuals; the first steps pay the compile).")
    torch_compile_backend: str = flag("inductor", "The torch.compile backend of --torch-compile: inductor (fused kernels), or aot_eager / eager, which trace the same graphs without generating code: they tell a capture problem from one of Inductor's kernels, and check a layout's graphs without Inductor's build of each kernel (torchtitan's compile.backend).", choices=("inductor", "aot_eager", "eager"))
    cuda_graphs: bool = flag(False, "Capture each transformer layer's forward and backward as CUDA graphs (Transformer Engine's make_graphed_callables) and replay them in training, for runs whose GPU waits on Python; TP=1, no PP, MoE, recompute, dropout or ZeRO-3 yet.",
                           aliases=("--external-cuda-graph",))
    gradient_accumulation_fusion: bool = flag(False, "Let Transformer Engine's weight-gradient GEMMs add each micro-batch's product into the accumulated gradients (Megatron's flag) instead of a separate addition per parameter; needs --transformer-impl transformer_engine, ZeRO 0 or 1 and no PP.")
    num_experts: Optional[int] = flag(None, "Mixture-of-Experts: routed experts per MoE layer (default: a dense model).")
    moe_layer_freq: int = flag(1, "MoE in every k-th layer (layers 0, k, 2k, ...); the others keep the dense MLP.")
    moe_ffn_hidden_size: Optional[int] = flag(None, "Inner width of each expert (default: --ffn-hidden-size).")
    moe_router_topk: int = flag(2, "Experts each token is routed to (by default a softmax over the chosen experts' logits, as Mixtral; see --moe-router-score-function and --moe-router-pre-softmax).")
    moe_aux_loss_coeff: float = flag(0.0, "Weight of the load-balancing loss (Switch/GShard: E x sum of token fraction x mean probability).")
    moe_router_load_balancing_type: str = flag("aux_loss", "Which load-balancing loss --moe-aux-loss-coeff weighs (Megatron's): aux_loss over each micro-batch's tokens, seq_aux_loss per sequence and averaged (DeepSeek-V2/V3), global_aux_loss with the token fractions of the whole data-parallel batch (accumulated over the step's micro-batches), or none.",
                                               choices=LOAD_BALANCING_TYPES)
    moe_z_loss_coeff: float = flag(0.0, "Weight of the router z-loss (mean squared log-sum-exp of the router logits).")
    moe_capacity_factor: Optional[float] = flag(None, "Expert capacity as a multiple of an even share of the micro-batch's assignments; each expert keeps what --moe-token-drop-policy prefers and drops the rest (default: dropless).",
                                                aliases=("--moe-expert-capacity-factor",))
    moe_shared_expert_intermediate_size: Optional[int] = flag(None, "Width of a shared expert every token also goes through (default: none).")
    moe_grouped_gemm: bool = flag(True, "Compute the experts as one grouped GEMM (torch.nn.functional.grouped_mm) where torch offers it; else a loop over experts.")
    moe_token_dispatcher_type: str = flag("allgather", "How tokens reach their experts in Megatron-LM; here both travel by all-to-all over EP, with the same result (dropless routing is unchanged).", choices=("allgather", "alltoall", "flex"))
    moe_router_score_function: str = flag("softmax", "Router scores: softmax (Mixtral, Qwen-MoE), sigmoid (DeepSeek-V3) or sqrtsoftplus; sigmoid-type scores are taken before the top-k and, for k > 1, normalised over the chosen experts.",
                                          choices=SCORE_FUNCTIONS)
    moe_router_pre_softmax: bool = flag(False, "Softmax over all experts before the top-k, the chosen probabilities used as they are (Qwen2-MoE without norm_topk_prob, DeepSeek-V2), instead of a softmax over the chosen logits; no effect on sigmoid-type scores.")
    moe_router_topk_scaling_factor: Optional[float] = flag(None, "Multiply the chosen experts' routing weights by this (DeepSeek-V3: 2.5; default: none).")
    moe_router_num_groups: Optional[int] = flag(None, "Group-limited routing (DeepSeek-V2/V3): the experts fall into this many equal groups (e.g. one per EP rank or node) and each token chooses its experts within its best --moe-router-group-topk groups.")
    moe_router_group_topk: Optional[int] = flag(None, "Group-limited routing: how many groups each token chooses its experts from (a group scores the sum of its best topk / group-topk experts' scores).")
    moe_router_enable_expert_bias: bool = flag(False, "Auxiliary-loss-free balancing (DeepSeek-V3): a per-expert bias, added to the scores for choosing experts only, moves by --moe-router-bias-update-rate after every step towards equal load; needs sigmoid-type scores.")
    moe_router_force_load_balancing: bool = flag(False, "Benchmarks only (Megatron's flag): every MoE layer routes by random normal logits in place of the router's, so each expert gets an even share in expectation, and the router's gradient passes straight through them; the model never learns its routing. Timing a run whose router has collapsed onto a few experts (as an untuned learning rate makes it in a few steps) times other GEMM shapes than a trained model's.")
    moe_router_bias_update_rate: float = flag(1e-3, "Step of the expert-bias update: bias += rate x sign(mean load - expert's load), the load counted over the whole step on every data-parallel rank.")
    moe_token_drop_policy: str = flag("probs", "With --moe-capacity-factor, which assignments an expert keeps: probs (the highest routing weights; Megatron's default), position (the earliest tokens), or choice_then_position (every first choice before any second choice, then the earliest tokens: GShard / DeepSpeed-MoE, hybridlm's rule before this flag).",
                                      choices=DROP_POLICIES)
    moe_shared_expert_gate: bool = flag(False, "Scale the shared expert's output by sigmoid(x . g) with a learned vector g per layer (Qwen2-MoE).")
    lora_rank: int = flag(0, "LoRA: train rank-R adapters beside the frozen linears instead of the whole model (0: no adapters).")
    lora_alpha: Optional[float] = flag(None, "LoRA: the adapters' product is scaled by alpha / R, PEFT's rule (default: R, a scale of 1, as PEFT's defaults r = alpha = 8).")
    lora_dropout: float = flag(0.0, "LoRA: dropout on the adapters' input (PEFT's lora_dropout).")
    lora_targets: str = flag("all-linear", f"LoRA: the linears that get adapters, a comma list of {', '.join(LORA_TARGETS)}, or all-linear (all of them; never the output layer); one adapter per fused weight (QKV, SwiGLU's gate and up).")
    quant_bits: Optional[int] = flag(None, "QLoRA: hold the frozen base's block linears (QKV, proj, fc1, fc2; not the embedding or output layer) in this many bits through bitsandbytes, quantized once at load and never trained; only 4 (ms-swift's --quant_bits; transformers' load_in_4bit). Needs --lora-rank (default: no quantization).",
                                      choices=(4,))
    quant_type: str = flag("nf4", "QLoRA: the 4-bit data type, NormalFloat (the QLoRA paper's) or plain FP4 (bitsandbytes' bnb_4bit_quant_type; transformers defaults to fp4, ms-swift and PEFT's QLoRA recipes to nf4).",
                           choices=("nf4", "fp4"))
    double_quant: bool = flag(True, "QLoRA: quantize the per-block scales again (8-bit, blocks of 256): about 0.37 bits per weight less (bnb_4bit_use_double_quant; on as in the QLoRA paper and ms-swift, off in transformers' default).")
    padded_vocab_size: Optional[int] = flag(None, "Derived: vocabulary padded for TP.", cli=False)
    packed_samples: bool = flag(False, "Derived from --packing: rows hold several samples that attention must keep apart.", cli=False)
    half_precision: bool = flag(False, "Derived from --bf16/--fp16: the layers compute in half precision (which attention kernels can run).", cli=False)
    params_dtype: str = flag("fp32", "Derived from --bf16/--fp16 (Megatron's params_dtype): the precision the weights are held in; a 4-bit base is quantized from it and dequantized to it.", cli=False)
    attention_block_kernel: str = flag("math", "Derived at start-up: the log-sum-exp attention kernel context parallelism runs block by block.", cli=False)

    def __post_init__(self):
        if self.num_query_groups is None or not self.group_query_attention:
            self.num_query_groups = self.num_attention_heads  # Megatron ignores --num-query-groups without GQA
        if self.kv_channels is None:
            if self.hidden_size % self.num_attention_heads:
                raise ConfigError(f"--hidden-size {self.hidden_size} is not divisible by --num-attention-heads {self.num_attention_heads}.")
            self.kv_channels = self.hidden_size // self.num_attention_heads
        if self.ffn_hidden_size is None:
            # arguments.py: int((4 * h * 2 / 3) / 64) * 64 with SwiGLU (rounded down), else 4 * h
            self.ffn_hidden_size = int((4 * self.hidden_size * 2 / 3) / 64) * 64 if self.swiglu else 4 * self.hidden_size
            if self.ffn_hidden_size < 1:
                raise ConfigError(f"--swiglu with --hidden-size {self.hidden_size} gives an MLP width of 0 by Megatron's rule "
                                  "(8/3 x hidden rounded down to 64); pass --ffn-hidden-size.")
        if self.transformer_impl is None:  # Megatron's default is transformer_engine; FP8 needs it
            self.transformer_impl = "transformer_engine" if self.fp8_format else "local"
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
        if self.lora_rank:
            self._check_lora()
        if self.quant_bits is not None and not self.lora_rank:
            raise ConfigError(f"--quant-bits {self.quant_bits} needs --lora-rank: a quantized base cannot be trained "
                              "(full fine-tuning), only adapters beside it.")

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

    def lora_target_names(self) -> tuple[str, ...]:
        """The linears that carry LoRA adapters (none without --lora-rank)."""
        if not self.lora_rank:
            return ()
        if self.lora_targets.strip() == "all-linear":
            return LORA_TARGETS
        return tuple(dict.fromkeys(n.strip() for n in self.lora_targets.split(",") if n.strip()))

    def _check_lora(self):
        if self.lora_rank < 0:
            raise ConfigError(f"--lora-rank must be positive (0: no adapters), got {self.lora_rank}.")
        if self.lora_alpha is not None and self.lora_alpha <= 0:
            raise ConfigError(f"--lora-alpha must be positive, got {self.lora_alpha}.")
        if not 0.0 <= self.lora_dropout < 1.0:
            raise ConfigError(f"--lora-dropout must be in [0, 1), got {self.lora_dropout}.")
        names = self.lora_target_names()
        unknown = [n for n in names if n not in LORA_TARGETS]
        if unknown or not names:
            raise ConfigError(f"--lora-targets {self.lora_targets}: {f'unknown linear {unknown[0]!r}' if unknown else 'names no linear'} "
                              f"(have: all-linear, or a comma list of {', '.join(LORA_TARGETS)}).")

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
        self._check_router()

    def _check_router(self):
        """Megatron's checks of the router options, each as one sentence."""
        k, experts = self.moe_router_topk, self.num_experts
        if k == 1 and self.moe_router_score_function == "softmax" and not self.moe_router_pre_softmax:
            raise ConfigError("--moe-router-topk 1 with softmax scores needs --moe-router-pre-softmax: a softmax over one "
                              "chosen logit is always 1, so the router would learn nothing from the language-model loss.")
        if self.moe_router_enable_expert_bias and self.moe_router_score_function == "softmax":
            raise ConfigError("--moe-router-enable-expert-bias needs --moe-router-score-function sigmoid (or sqrtsoftplus), "
                              "as in DeepSeek-V3 and Megatron.")
        if self.moe_router_bias_update_rate < 0:
            raise ConfigError(f"--moe-router-bias-update-rate must not be negative, got {self.moe_router_bias_update_rate}.")
        if self.moe_router_topk_scaling_factor is not None and self.moe_router_topk_scaling_factor <= 0:
            raise ConfigError(f"--moe-router-topk-scaling-factor must be positive, got {self.moe_router_topk_scaling_factor}.")
        if self.moe_shared_expert_gate and not self.moe_shared_expert_intermediate_size:
            raise ConfigError("--moe-shared-expert-gate needs --moe-shared-expert-intermediate-size: there is no shared expert to gate.")
        groups, chosen = self.moe_router_num_groups, self.moe_router_group_topk
        if (groups is None) != (chosen is None):
            raise ConfigError("--moe-router-num-groups and --moe-router-group-topk go together: give both or neither.")
        if groups is not None:
            if groups < 1 or experts % groups:
                raise ConfigError(f"--moe-router-num-groups {groups} must divide --num-experts {experts}.")
            if not 1 <= chosen <= groups or k % chosen or chosen * (experts // groups) < k:
                raise ConfigError(f"--moe-router-group-topk {chosen} must be between 1 and --moe-router-num-groups {groups}, divide "
                                  f"--moe-router-topk {k}, and its groups must hold at least {k} experts.")

    def is_moe_layer(self, layer_number: int) -> bool:
        """Whether 0-based layer ``layer_number`` has experts instead of the dense MLP (Megatron's rule)."""
        return self.num_experts is not None and layer_number % self.moe_layer_freq == 0

    def pad_vocab(self, tensor_parallel: int) -> int:
        multiple = self.make_vocab_size_divisible_by * tensor_parallel
        return multiple * math.ceil(self.vocab_size / multiple)

