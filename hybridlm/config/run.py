"""RunConfig: the four sections together, and ``validate`` for every cross-constraint.

``validate(world_size)`` runs before any process group exists, so a bad layout ends in one
sentence on every rank instead of a hang inside a collective.
"""
from __future__ import annotations

import copy
import dataclasses
import math
from dataclasses import dataclass, field

from . import megatron
from .fields import ConfigError, refuse_first
from .model import QUANT_BLOCK, ModelConfig
from .sections import DataConfig, ParallelConfig, PostTrainConfig, TrainConfig

# Settings that ``validate`` fills in from the others when left unset, or turns off for this layout: a saved
# config.yaml keeps what was given for them (usually nothing), so a run that reuses it resolves them again from
# its own flags (a longer --train-iters decays over its own length, another world size gets its own global batch).
RESOLVED_BY_VALIDATE = ("global_batch_size", "train_iters", "lr_decay_iters", "lr_wsd_decay_iters", "lr_wsd_decay_samples",
                        "sequence_parallel", "partition_activations", "recompute_modules",
                        "check_weight_hash_across_dp_replicas_interval")
RECOMPUTE_MODULES = ("core_attn", "mlp", "moe")  # what --recompute-modules can name here
# Megatron-LM's other modules (output-discarding recompute of norms and activations, MLA, split experts, overlap).
MEGATRON_ONLY_RECOMPUTE_MODULES = ("moe_act", "mlp_act", "layernorm", "mla_up_proj", "pre_mlp", "shared_experts",
                                   "routed_experts", "a2a_overlap_attn", "a2a_overlap_post_attn", "a2a_overlap_mlp")

@dataclass
class RunConfig:
    model: ModelConfig
    parallel: ParallelConfig
    train: TrainConfig
    data: DataConfig = field(default_factory=DataConfig)
    posttrain: PostTrainConfig = field(default_factory=PostTrainConfig)
    explicit: frozenset = frozenset()  # flags the user typed (so a JSON value can win over a default)
    notes: list = field(default_factory=list)  # lines for the run log: what a Megatron flag maps to here
    typed: frozenset = None  # the flags given on the command line or in --config, not by a preset (default: explicit)
    given_values: dict = field(default_factory=dict)  # {name: value before validate} of the RESOLVED_BY_VALIDATE it changed

    @property
    def gradient_accumulation_steps(self) -> int:
        return self.train.global_batch_size // (self.train.micro_batch_size * self.parallel.data_parallel_size)

    def validate(self, world_size: int) -> "RunConfig":
        """Check the layout against the world and fill derived fields. Pure: no process groups."""
        before = self._derivable_values()
        self._validate(world_size)
        after = self._derivable_values()
        for name, value in before.items():
            if name not in self.given_values and after[name] != value:
                self.given_values[name] = value
        return self

    def _derivable_values(self) -> dict:
        """The current values of RESOLVED_BY_VALIDATE (copied: validate may replace a list)."""
        sections = (self.parallel, self.train)
        return {name: copy.copy(getattr(next(s for s in sections if hasattr(s, name)), name)) for name in RESOLVED_BY_VALIDATE}

    def _validate(self, world_size: int) -> None:
        m, p, t = self.model, self.parallel, self.train
        tp, pp, ep = p.tensor_model_parallel_size, p.pipeline_model_parallel_size, p.expert_model_parallel_size
        cp = p.context_parallel_size
        for flag, v in (("--tensor-model-parallel-size", tp), ("--pipeline-model-parallel-size", pp), ("--expert-model-parallel-size", ep),
                        ("--context-parallel-size", cp)):
            if v < 1:
                raise ConfigError(f"{flag} must be at least 1, got {v}.")
        if world_size % (tp * pp * cp):
            if cp == 1:
                raise ConfigError(f"world size {world_size} is not a multiple of TP x PP = {tp} x {pp}; it must equal TP x PP x DP.")
            raise ConfigError(f"world size {world_size} is not a multiple of TP x PP x CP = {tp} x {pp} x {cp}; it must equal TP x PP x CP x DP.")
        p.data_parallel_size = world_size // (tp * pp * cp)
        m.half_precision = t.bf16 or t.fp16
        m.params_dtype = "bf16" if t.bf16 else "fp16" if t.fp16 else "fp32"
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
        if p.data_parallel_size * cp % ep:
            what = f"the data-parallel size {p.data_parallel_size}" if cp == 1 else f"DP x CP = {p.data_parallel_size} x {cp}"
            raise ConfigError(f"--expert-model-parallel-size {ep} does not divide {what} "
                              f"(world {world_size} / (TP x PP) = {p.data_parallel_size * cp}); EP is carved out of DP x CP.")
        if m.num_experts is not None:
            self._check_moe_layout(tp, ep)
            if m.moe_router_force_load_balancing:
                self.notes.append("--moe-router-force-load-balancing: every MoE layer routes by random logits, as Megatron-LM's "
                                  "benchmark setting does; the loads are even, and the router never learns to route.")
        if p.sequence_parallel and tp == 1:  # nothing to shard over: Megatron-LM warns and turns it off, as here
            p.sequence_parallel = False
            self.notes.append("--sequence-parallel is off: it shards activations over the TP ranks, and "
                              "--tensor-model-parallel-size is 1 (Megatron-LM turns it off the same way).")
        if p.sequence_parallel and m.seq_length % tp:
            raise ConfigError(f"--seq-length {m.seq_length} is not divisible by --tensor-model-parallel-size {tp}, which --sequence-parallel needs.")
        if cp > 1:
            self._check_context_parallel(tp, cp)
        if p.recompute_num_layers is not None and p.recompute_granularity != "full":
            raise ConfigError("--recompute-num-layers needs --recompute-granularity full.")
        if p.recompute_method is not None and p.recompute_granularity != "full":
            raise ConfigError("--recompute-method needs --recompute-granularity full, as in Megatron-LM.")
        if p.recompute_method is not None and p.recompute_num_layers is None:
            raise ConfigError(f"--recompute-method {p.recompute_method} needs --recompute-num-layers, as in Megatron-LM.")
        self._check_recompute_modules()
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
        self._check_uneven_pipeline(pp)
        if m.torch_compile_backend != "inductor" and not m.torch_compile:
            raise ConfigError(f"--torch-compile-backend {m.torch_compile_backend} needs --torch-compile: without it nothing is compiled.")
        if m.torch_compile and ep > 1:
            raise ConfigError(f"--torch-compile cannot be combined with --expert-model-parallel-size {ep} yet: the expert "
                              "all-to-all has not been checked inside compiled layers on NCCL; compile works with EP=1 under TP, DP, PP and ZeRO.")
        if m.quant_bits is not None:
            self._check_quantized_base(tp)
        if m.lora_rank:
            self._check_lora()
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
        self._check_schedule()
        self._check_optimizer()
        if t.keep_last_n_checkpoints is not None and t.keep_last_n_checkpoints < 1:
            raise ConfigError(f"--keep-last-n-checkpoints must be at least 1, got {t.keep_last_n_checkpoints}.")
        if t.eval_interval is not None and (t.eval_interval < 1 or t.eval_iters < 1):
            raise ConfigError(f"--eval-interval {t.eval_interval} and --eval-iters {t.eval_iters} must be positive.")
        if t.ckpt_step is not None and not t.load:
            raise ConfigError("--ckpt-step needs --load.")
        if t.finetune and not t.load:
            raise ConfigError("--finetune needs --load: it says what to take from the loaded checkpoint.")
        interval = t.check_weight_hash_across_dp_replicas_interval
        if interval is not None and interval < 1:
            raise ConfigError(f"--check-weight-hash-across-dp-replicas-interval must be at least 1, got {interval}.")
        if interval is not None and p.data_parallel_size * cp == 1:  # no rank holds a copy of another's weights
            t.check_weight_hash_across_dp_replicas_interval = None
            self.notes.append("--check-weight-hash-across-dp-replicas-interval is off: DP x CP is 1, so no two ranks hold "
                              "the same weights to compare.")
        if t.manual_gc_interval < 0 or (t.manual_gc_interval and not t.manual_gc):
            raise ConfigError(f"--manual-gc-interval {t.manual_gc_interval} needs --manual-gc and must not be negative.")
        if t.exit_signal_handler and not t.save:
            raise ConfigError("--exit-signal-handler needs --save: the checkpoint it writes on the signal has to go somewhere.")
        self._check_posttrain()
        if m.vocab_size is not None:
            m.padded_vocab_size = m.pad_vocab(tp)
        self.notes.extend(line for line in megatron.check(self) if line not in self.notes)

    def _check_schedule(self) -> None:
        """Megatron-LM's rules (arguments.py, training.py get_optimizer_param_scheduler): a run counts
        iterations or samples, never both; the warm-up ends before the decay does."""
        t = self.train
        g = t.global_batch_size
        typed = self.explicit if self.typed is None else self.typed
        if t.train_samples is not None:
            for name in ("lr_warmup_iters", "lr_decay_iters", "lr_wsd_decay_iters"):
                if name not in typed:  # a preset's iteration-based schedule gives way to the samples one
                    setattr(t, name, 0 if name == "lr_warmup_iters" else None)
            refuse_first("--train-samples", (
                ("train_iters" in typed and t.train_iters != t.train_samples // g,
                 f"--train-iters {t.train_iters} (give one of them, as in Megatron-LM)"),
                (t.lr_decay_iters is not None, "--lr-decay-iters; use --lr-decay-samples"),
                (t.lr_warmup_iters != 0, "--lr-warmup-iters; use --lr-warmup-samples"),
                (t.lr_wsd_decay_iters is not None, "--lr-wsd-decay-iters; use --lr-wsd-decay-samples")))
            t.train_iters = t.train_samples // g  # training.py update_train_iters, for a constant batch
        else:
            for name in ("lr_decay_samples", "lr_wsd_decay_samples", "lr_warmup_samples"):
                if getattr(t, name):
                    flag = "--" + name.replace("_", "-")
                    raise ConfigError(f"{flag} needs --train-samples; with --train-iters use {flag.replace('-samples', '-iters')}.")
        if t.train_iters < 1:
            raise ConfigError(f"--train-iters must be positive, got {t.train_iters}"
                              f"{f' (--train-samples {t.train_samples} / --global-batch-size {g})' if t.train_samples else ''}.")
        if t.lr_warmup_fraction is not None and "lr_warmup_fraction" not in typed and \
                {"lr_warmup_iters", "lr_warmup_samples"} & typed:
            t.lr_warmup_fraction = None  # a preset's warm-up fraction gives way to the warm-up typed
        if t.lr_warmup_fraction is not None and "lr_warmup_iters" not in typed:
            t.lr_warmup_iters = 0  # a preset's warm-up gives way to the fraction
        if t.lr_warmup_fraction is not None and not 0 <= t.lr_warmup_fraction < 1:
            raise ConfigError(f"--lr-warmup-fraction must be in [0, 1) (a share of the decay), got {t.lr_warmup_fraction:g}.")
        if t.lr_warmup_fraction is not None and (t.lr_warmup_iters or t.lr_warmup_samples):
            raise ConfigError("--lr-warmup-fraction cannot be combined with --lr-warmup-iters or --lr-warmup-samples; give one of them.")
        wsd = t.lr_decay_style in ("wsd", "WSD")
        if t.train_samples is None:
            if t.lr_decay_iters is None:
                t.lr_decay_iters = t.train_iters
            if wsd and t.lr_wsd_decay_iters is None:
                t.lr_wsd_decay_iters = max(1, t.lr_decay_iters // 10)
        elif wsd and t.lr_wsd_decay_samples is None:
            t.lr_wsd_decay_samples = max(1, (t.lr_decay_samples or t.train_samples) // 10)
        warmup, decay, _ = t.schedule_in_samples()
        if warmup >= decay:
            raise ConfigError(self._warmup_too_long(warmup, decay, typed))
        self._refuse_steps_at_lr_0(decay)
        if t.decoupled_min_lr is not None and t.decoupled_lr is None:
            raise ConfigError("--decoupled-min-lr needs --decoupled-lr.")

    def _refuse_steps_at_lr_0(self, decay: float) -> None:
        """A decay that reaches --min-lr 0 before the run ends would train its last steps at LR 0 and exit 0 (step i
        trains at the rate of i x global batch samples): Megatron-LM allows it, but it is never what was meant (a
        decay length reused from another run's settings, a longer --train-iters)."""
        t = self.train
        g = t.global_batch_size
        zero_steps = t.train_iters - math.ceil(decay / g)
        if zero_steps <= 0 or t.min_lr > 0 or t.lr == 0 or t.lr_decay_style == "constant":
            return
        if t.train_samples is not None:
            where = f"--lr-decay-samples {t.lr_decay_samples} ends the decay at sample {t.lr_decay_samples} of --train-samples {t.train_samples}"
            fix = "drop --lr-decay-samples (it defaults to --train-samples), raise it"
        else:
            where = f"--lr-decay-iters {t.lr_decay_iters} ends the decay at iteration {t.lr_decay_iters} of --train-iters {t.train_iters}"
            fix = "drop --lr-decay-iters (it defaults to --train-iters), raise it"
        raise ConfigError(f"{where} with --min-lr 0: the last {zero_steps} iterations would train at LR 0; {fix}, "
                          "or give --min-lr above 0.")

    def _check_optimizer(self) -> None:
        """What torch's AdamW would refuse with a traceback after the process group exists."""
        t = self.train
        for flag, value in (("--lr", t.lr), ("--min-lr", t.min_lr), ("--lr-warmup-init", t.lr_warmup_init),
                            ("--decoupled-lr", t.decoupled_lr), ("--decoupled-min-lr", t.decoupled_min_lr),
                            ("--weight-decay", t.weight_decay), ("--adam-eps", t.adam_eps), ("--clip-grad", t.clip_grad)):
            if value is not None and not value >= 0:  # NaN too
                raise ConfigError(f"{flag} must not be negative, got {value:g}.")
        for flag, value in (("--adam-beta1", t.adam_beta1), ("--adam-beta2", t.adam_beta2)):
            if not 0 <= value < 1:
                raise ConfigError(f"{flag} must be in [0, 1), got {value:g}.")

    def _warmup_too_long(self, warmup: float, decay: float, typed: frozenset) -> str:
        """The schedule refusal, naming every flag that fixes it (and the preset a warm-up came from)."""
        t = self.train
        samples = t.train_samples is not None
        unit, per = ("samples", 1) if samples else ("iterations", t.global_batch_size)
        name = "lr_warmup_samples" if samples else "lr_warmup_iters"  # a fraction below 1 always fits
        warm_flag, decay_flag = "--" + name.replace("_", "-"), "--lr-decay-samples" if samples else "--lr-decay-iters"
        run_flag = "--train-samples" if samples else "--train-iters"
        preset = f" from --model {self.model.model}" if name not in typed and self.model.model else ""
        return (f"the warm-up ({warmup / per:g} {unit}: {warm_flag} {getattr(t, name)}{preset}) must end before the decay "
                f"({decay / per:g} {unit}: {decay_flag}, default {run_flag}) does, as Megatron-LM requires; shorten the "
                f"warm-up with {warm_flag}{' (yours wins over the preset)' if preset else ''} or --lr-warmup-fraction, or "
                f"lengthen the decay with {decay_flag} or {run_flag}.")

    def _check_posttrain(self) -> None:
        """--task and its settings (the data files themselves are checked when the task reads them)."""
        f, t, d = self.posttrain, self.train, self.data
        self.model.packed_samples = f.packing
        if f.packing and f.task != "sft":
            raise ConfigError(f"--packing needs --task sft (this run is --task {f.task}).")
        if f.packing and self.model.cuda_graphs:
            raise ConfigError("--packing cannot be combined with --cuda-graphs: a captured layer takes the activations alone, "
                              "not the position ids that keep packed samples apart.")
        defaults = PostTrainConfig()
        for task, names in (("dpo", DPO_SETTINGS), ("grpo", GRPO_SETTINGS)):
            given = [n for n in names if getattr(f, n) != getattr(defaults, n)]
            if f.task != task and given:
                raise ConfigError(f"--{given[0].replace('_', '-')} needs --task {task} (this run is --task {f.task}).")
        if f.task == "pretrain":
            return
        source = "a JSONL file of prompts" if f.task == "grpo" else "a prefix written by scripts/preprocess_chat.py"
        if d.data_path is None:
            raise ConfigError(f"--task {f.task} needs --data-path: {source}.")
        words = [w for item in d.data_path for w in str(item).split()]
        if len(words) != 1:
            raise ConfigError(f"--task {f.task} takes one --data-path, {source} (got {' '.join(words)}).")
        if t.eval_interval:
            raise ConfigError(f"--eval-interval cannot be combined with --task {f.task} yet: fine-tuning runs have no "
                              "validation split; leave it out.")
        if f.task == "dpo":
            if f.dpo_beta <= 0:
                raise ConfigError(f"--dpo-beta must be positive, got {f.dpo_beta}.")
            if not 0 <= f.dpo_label_smoothing < 0.5:
                raise ConfigError(f"--dpo-label-smoothing must be in [0, 0.5), got {f.dpo_label_smoothing}.")
            if f.dpo_label_smoothing and f.dpo_loss != "sigmoid":
                raise ConfigError(f"--dpo-label-smoothing applies to --dpo-loss sigmoid, not {f.dpo_loss}.")
            if f.rpo_alpha is not None and f.rpo_alpha < 0:
                raise ConfigError(f"--rpo-alpha must not be negative, got {f.rpo_alpha}.")
            if f.reference == "none" and f.ref_load:
                raise ConfigError("--ref-load cannot be combined with --reference none: a reference-free run reads no reference model.")
            if not t.load:
                raise ConfigError("--task dpo needs --load: the policy starts from a checkpoint (and the reference defaults to it).")
        if f.task == "grpo":
            self._check_grpo()

    def _check_grpo(self) -> None:
        """GRPO's settings, its batch (counted in completions) and the layouts its rollouts run on."""
        f, t, p, m = self.posttrain, self.train, self.parallel, self.model
        refuse_first("--task grpo", (
            (p.pipeline_model_parallel_size > 1, f"--pipeline-model-parallel-size {p.pipeline_model_parallel_size}: rollouts "
             "decode one token at a time through every layer, which the pipeline schedule does not run; fit the model with "
             "--tensor-model-parallel-size and ZeRO-3 (or --lora-rank) instead"),
            (m.num_experts is not None, "--num-experts yet: the rollout decoder has not been checked with routed experts; use a dense model"),
            (m.cuda_graphs, "--cuda-graphs: rollout rows change length every step, and a captured layer has one shape; drop --cuda-graphs"),
            (m.fp8_format is not None, f"--fp8-format {m.fp8_format}: rollouts decode a token per row at a time, shapes FP8 GEMMs "
             "do not take (multiples of 16); train GRPO in bf16"),
        ))
        if not t.load:
            raise ConfigError("--task grpo needs --load: the policy starts from a checkpoint (and the reference is its weights).")
        if not f.reward_funcs:
            raise ConfigError("--task grpo needs --reward-funcs: accuracy, format, or path/to/file.py:name (see the README).")
        if f.reward_weights is not None:
            try:
                f.reward_weights = [float(w) for w in f.reward_weights]
            except (TypeError, ValueError):
                raise ConfigError(f"--reward-weights takes numbers, got {' '.join(map(str, f.reward_weights))}.") from None
            if len(f.reward_weights) != len(f.reward_funcs):
                raise ConfigError(f"--reward-weights gives {len(f.reward_weights)} weights for {len(f.reward_funcs)} "
                                  "--reward-funcs; give one per function.")
        for flag, bad, need in (("--num-generations", f.num_generations < 2, "at least 2 (advantages compare a prompt's completions)"),
                                ("--max-completion-length", f.max_completion_length < 1, "positive"),
                                ("--temperature", not f.temperature > 0, "positive"),
                                ("--top-p", not 0 < f.top_p <= 1, "in (0, 1]"), ("--top-k", f.top_k < 0, "non-negative"),
                                ("--beta", not f.beta >= 0, "non-negative"), ("--epsilon", not 0 <= f.epsilon < 1, "in [0, 1)"),
                                ("--epsilon-high", f.epsilon_high is not None and not f.epsilon_high >= 0, "non-negative"),
                                ("--num-iterations", f.num_iterations < 1, "at least 1")):
            if bad:
                value = getattr(f, flag[2:].replace("-", "_"))
                raise ConfigError(f"{flag} must be {need}, got {value}.")
        if f.max_completion_length >= m.seq_length:
            raise ConfigError(f"--max-completion-length {f.max_completion_length} leaves no room for a prompt in --seq-length "
                              f"{m.seq_length} (a row holds the prompt and its completion).")
        per_replica, g = t.global_batch_size // p.data_parallel_size, f.num_generations
        if per_replica % g:
            raise ConfigError(f"--global-batch-size {t.global_batch_size} counts completions, and each of the {p.data_parallel_size} "
                              f"data-parallel replicas samples all {g} (--num-generations) of its prompts: it must be a multiple "
                              f"of {g} x {p.data_parallel_size}.")

    def _check_context_parallel(self, tp: int, cp: int) -> None:
        """What CP needs of the sequence and the heads, and what it has not been made to work with."""
        m, p = self.model, self.parallel
        flag = f"--context-parallel-size {cp}"
        if m.seq_length % (2 * cp):
            raise ConfigError(f"--seq-length {m.seq_length} is not divisible by 2 x CP = {2 * cp}: {flag} cuts each sample "
                              "into 2 x CP chunks (rank i holds chunks i and 2CP-1-i, so causal work is balanced).")
        if p.sequence_parallel and (m.seq_length // cp) % tp:
            raise ConfigError(f"--seq-length {m.seq_length} / CP {cp} = {m.seq_length // cp} tokens per CP rank is not divisible by "
                              f"--tensor-model-parallel-size {tp}, which --sequence-parallel needs.")
        heads = m.num_attention_heads // tp
        if p.cp_comm_type == "a2a" and heads % cp:
            raise ConfigError(f"--cp-comm-type a2a cannot split {heads} attention heads per TP rank (--num-attention-heads "
                              f"{m.num_attention_heads} / TP {tp}) over {flag}; use --cp-comm-type p2p or allgather.")
        refuse_first(flag, (
            (m.position_embedding_type == "learned_absolute", "--position-embedding-type learned_absolute: "
             "use rope (each rank rotates its tokens by their global positions)"),
            (m.cuda_graphs, "--cuda-graphs: a captured layer cannot hold the ring's send/recv; drop --cuda-graphs"),
            (m.torch_compile, "--torch-compile yet: the ring's send/recv inside compiled layers has not been checked on NCCL; "
             "drop --torch-compile"),
            (m.attention_backend == "te", "--attention-backend te: Transformer Engine's own CP is not wired in; use flash, cudnn or sdpa"),
            (m.attention_dropout > 0 and p.cp_comm_type != "a2a", f"--attention-dropout {m.attention_dropout} with --cp-comm-type "
             f"{p.cp_comm_type}: its blockwise kernels draw no dropout; use --cp-comm-type a2a or --attention-dropout 0"),
            (m.moe_capacity_factor is not None, f"--moe-capacity-factor {m.moe_capacity_factor}: which tokens an expert drops "
             "would depend on how CP slices the sequence; use dropless routing (no capacity factor)"),
            (self.posttrain.packing and p.cp_comm_type != "a2a", f"--packing with --cp-comm-type {p.cp_comm_type}: its "
             "block-wise attention cannot keep packed samples apart; use --cp-comm-type a2a, or drop --packing "
             "(one conversation per row)"),
        ))

    def _check_quantized_base(self, tp: int) -> None:
        """What a 4-bit base (QLoRA, ``hybridlm.parallel.quantized``) cannot sit beside (one refusal each)."""
        import importlib.util
        m, p, t = self.model, self.parallel, self.train
        flag = f"--quant-bits {m.quant_bits}"
        refuse_first(flag, (
            (m.fp8_format is not None, f"--fp8-format {m.fp8_format}: the base's GEMMs dequantize its 4-bit weights to "
             "bf16, and the adapters sit beside this project's linears, not Transformer Engine's; drop --fp8-format"),
            (m.transformer_impl == "transformer_engine", "--transformer-impl transformer_engine: the 4-bit base sits in "
             "this project's linears, not Transformer Engine's; use --transformer-impl local"),
            (p.zero_stage == 3, f"ZeRO stage 3 (from {t.deepspeed_config}): it partitions parameters, and the 4-bit base "
             "is held beside DeepSpeed's parameters, never trained; use ZeRO-1 or 2, which shard the adapters' optimizer state"),
            (bool(t.save) and not t.load, f"--save {t.save} without --load: a QLoRA checkpoint keeps the adapters and names "
             "the checkpoint its base was quantized from, and a base drawn from --seed is none; --load the base "
             "(convert_from_hf.py's output or a training run)"),
        ))
        if importlib.util.find_spec("bitsandbytes") is None:
            raise ConfigError(f"{flag} needs bitsandbytes, which is not installed here (pip install 'hybridlm[qlora]', "
                              "or pip install bitsandbytes).")
        if tp > 1:
            widths = (("--hidden-size", m.hidden_size, 1), ("the attention's output projection input (heads x kv-channels)",
                      m.num_attention_heads * m.kv_channels, tp), ("--ffn-hidden-size", m.ffn_hidden_size, tp))
            for what, width, split in widths:
                if (width // split) % QUANT_BLOCK:
                    per_rank = f"{width} / TP {tp} = {width // split}" if split > 1 else str(width)
                    raise ConfigError(f"{flag} with --tensor-model-parallel-size {tp}: each rank keeps whole "
                                      f"{QUANT_BLOCK}-weight quantization blocks of every row, and {what} gives {per_rank}, "
                                      f"not a multiple of {QUANT_BLOCK}; use a TP that keeps it one, or TP 1.")

    def _check_lora(self) -> None:
        """What the adapters cannot sit beside yet (one refusal each)."""
        m, p = self.model, self.parallel
        refuse_first("--lora-rank", (
            (p.zero_stage == 3, f"ZeRO stage 3 (from {self.train.deepspeed_config}): it would partition the frozen base as well, "
             "which the adapters' loading has not been checked with; use ZeRO-1 or 2, which shard the adapters' optimizer state"),
            (bool(self.posttrain.ref_load), f"--ref-load {self.posttrain.ref_load}: with adapters DPO's reference is the "
             "loaded base with the adapters switched off; drop --ref-load"),
            (m.transformer_impl == "transformer_engine", "--transformer-impl transformer_engine (FP8 included): the adapters sit "
             "beside this project's linears, not Transformer Engine's; use --transformer-impl local with --bf16"),
            (m.cuda_graphs, "--cuda-graphs: the captured layers have not been checked with frozen weights and adapters; drop it"),
            (m.gradient_accumulation_fusion, "--gradient-accumulation-fusion: it fuses Transformer Engine's weight gradients, "
             "and a frozen base has none; drop it"),
            (m.num_experts is not None, "--num-experts: adapters on routed experts are not implemented; train the MoE model "
             "without --lora-rank (ZeRO-3 with CPU offload fits larger ones)"),
        ))

    def _check_recompute_modules(self) -> None:
        """Megatron-LM's --recompute-modules: applies to selective recompute only (ignored otherwise, as there);
        the default is the attention core. Megatron's other modules are refused by name."""
        p = self.parallel
        if p.recompute_granularity != "selective":
            if p.recompute_modules:
                self.notes.append(f"--recompute-modules {' '.join(p.recompute_modules)} does nothing without --recompute-granularity "
                                  "selective (Megatron-LM ignores it the same way).")
            p.recompute_modules = []
            return
        if p.recompute_modules is None:
            p.recompute_modules = ["core_attn"]
        unknown = [name for name in p.recompute_modules if name not in RECOMPUTE_MODULES]
        if unknown:
            later = unknown[0] in MEGATRON_ONLY_RECOMPUTE_MODULES
            raise ConfigError(f"--recompute-modules {unknown[0]}: " + ("Megatron-LM's recompute of that part is not implemented "
                              "here" if later else "unknown module") + f"; hybridlm recomputes {', '.join(RECOMPUTE_MODULES)}.")
        p.recompute_modules = list(dict.fromkeys(p.recompute_modules))
        m = self.model
        idle = [("moe", m.num_experts is None, "the model has no MoE layers (no --num-experts)"),
                ("mlp", m.num_experts is not None and m.moe_layer_freq == 1, "every layer's MLP is an MoE layer (use moe)")]
        for module, does_nothing, why in idle:
            if module in p.recompute_modules and does_nothing:
                p.recompute_modules.remove(module)
                self.notes.append(f"--recompute-modules {module} does nothing here: {why}.")

    def _check_cuda_graphs(self, tp: int, pp: int) -> None:
        """What a captured layer cannot replay, or has not been checked with (one refusal each)."""
        m, p = self.model, self.parallel
        refuse_first("--cuda-graphs", (
            (pp > 1, f"--pipeline-model-parallel-size {pp}: the pipeline engine runs its own micro-batch schedule"),
            (tp > 1, f"--tensor-model-parallel-size {tp}: TP collectives inside captured graphs have not been checked yet"),
            (m.num_experts is not None, "--num-experts: routing sends each expert a different number of tokens every micro-batch"),
            (p.recompute_granularity is not None, f"--recompute-granularity {p.recompute_granularity}: recompute re-enters the layer in backward"),
            (m.hidden_dropout > 0 or m.attention_dropout > 0, "dropout: its RNG tracker swaps generator states, which a replay would not"),
            (p.zero_stage == 3, f"ZeRO stage 3 (from {self.train.deepspeed_config}): it gathers parameters in module hooks"),
            (m.torch_compile and m.transformer_impl != "transformer_engine",
             "--torch-compile under --transformer-impl local: a layer compiled whole and then captured gave NaN input "
             "gradients and an illegal memory access on H200s (TE's linears with compiled pieces between them are fine); "
             "add --transformer-impl transformer_engine, or drop one of the two flags"),
        ))

    def _check_uneven_pipeline(self, pp: int) -> None:
        """Megatron-LM's --decoder-first/last-pipeline-num-layers: every stage keeps at least one layer and
        the stages between the given ones share the rest evenly."""
        p, n = self.parallel, self.model.num_layers
        given = [(flag, v) for flag, v in (("--decoder-first-pipeline-num-layers", p.decoder_first_pipeline_num_layers),
                                           ("--decoder-last-pipeline-num-layers", p.decoder_last_pipeline_num_layers)) if v is not None]
        if not given:
            return
        named = " and ".join(f"{flag} {v}" for flag, v in given)
        if pp == 1:
            raise ConfigError(f"{named} needs --pipeline-model-parallel-size > 1: one stage holds every layer.")
        if len(given) == 2 and pp == 2 and sum(v for _, v in given) != n:
            raise ConfigError(f"{named} must add up to --num-layers {n} with two pipeline stages.")
        rest, middle = n - sum(v for _, v in given), pp - len(given)
        if any(v < 1 for _, v in given) or rest < middle or (middle and rest % middle):
            raise ConfigError(f"{named} leave {rest} of --num-layers {n} for the other {middle} pipeline stage(s), which must "
                              "share them evenly with at least one layer each.")

    def _check_gradient_accumulation_fusion(self, pp: int) -> None:
        m, p = self.model, self.parallel
        refuse_first("--gradient-accumulation-fusion", (
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
        return {name: dataclasses.asdict(getattr(self, name)) for name, _ in SECTIONS}


DPO_SETTINGS = ("dpo_beta", "dpo_loss", "dpo_label_smoothing", "reference", "ref_load", "rpo_alpha")
GRPO_SETTINGS = ("num_generations", "max_completion_length", "temperature", "top_p", "top_k", "beta", "epsilon", "epsilon_high",
                 "num_iterations", "loss_type", "scale_rewards", "mask_truncated_completions", "reward_funcs", "reward_weights",
                 "format_pattern")

SECTIONS = (("model", ModelConfig), ("parallel", ParallelConfig), ("train", TrainConfig), ("data", DataConfig),
            ("posttrain", PostTrainConfig))
