"""The run's other sections: how the model is laid out, how it is trained, where data comes from."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from .fields import flag

@dataclass
class ParallelConfig:
    """How the model is laid out over ranks. DP is whatever the world leaves over."""

    tensor_model_parallel_size: int = flag(1, "TP: ranks that split each weight matrix.")
    pipeline_model_parallel_size: int = flag(1, "PP: pipeline stages (DeepSpeed's 1F1B engine when > 1).")
    decoder_first_pipeline_num_layers: Optional[int] = flag(None, "Transformer layers on the first pipeline stage; the others share the rest evenly (Megatron-LM's flag; default: an even split). The last stage also runs the output layer and the loss, so fewer layers there balance it.")
    decoder_last_pipeline_num_layers: Optional[int] = flag(None, "Transformer layers on the last pipeline stage; the others share the rest evenly (Megatron-LM's flag; default: an even split).")
    expert_model_parallel_size: int = flag(1, "EP: ranks that split the experts (carved out of DP x CP).")
    context_parallel_size: int = flag(1, "CP: ranks that split each sample's sequence (long context); to DeepSpeed they are data-parallel replicas.")
    cp_comm_type: str = flag("p2p", "How CP ranks attend over the whole sequence: p2p (ring attention, K/V passed around), a2a (all-to-all to heads, Ulysses), allgather (K/V gathered).",
                             choices=("p2p", "a2a", "allgather"))
    sequence_parallel: bool = flag(False, "Megatron sequence parallelism: shard norms/dropout activations over TP.")
    recompute_granularity: Optional[str] = flag(None, "Activation recompute: whole layers or only core attention.", choices=("full", "selective"))
    recompute_method: Optional[str] = flag(None, "With full recompute: uniform (every group of --recompute-num-layers layers checkpointed as one unit) or block (the first --recompute-num-layers layers of each stage, one unit each) (default: every layer, one unit each).", choices=("uniform", "block"))
    recompute_num_layers: Optional[int] = flag(None, "With full recompute: layers per unit (uniform) or layers recomputed per stage (block; without --recompute-method too) (default: all).")
    recompute_modules: Optional[list] = flag(None, "With selective recompute: the parts of each layer that keep only their input and run again in backward: core_attn (the attention core), mlp (a dense layer's MLP, after its norm), moe (an MoE layer's router and experts, after its norm) (default: core_attn, as Megatron-LM).", nargs="*")
    partition_activations: Optional[bool] = flag(None, "Split checkpointed activations over TP (default: on with TP>1 and full recompute, off with SP).")
    use_distributed_optimizer: bool = flag(False, "Shard the optimizer state over DP (Megatron's distributed optimizer): DeepSpeed's ZeRO, stage 1 or more in the JSON.")
    overlap_grad_reduce: bool = flag(False, "Overlap the gradient reduction with backward: DeepSpeed's overlap_comm (ZeRO 1-3, PP = 1).")
    overlap_param_gather: bool = flag(False, "Overlap the parameter all-gather with the next forward: ZeRO-3 prefetches parameters; ZeRO-1/2 gather inside the step, so it changes nothing there.")
    zero_stage: int = flag(0, "Derived from the DeepSpeed JSON.", cli=False)
    data_parallel_size: int = flag(1, "Derived: world / (TP x PP x CP).", cli=False)


def pipeline_stage_layers(num_layers: int, pp: int, first: Optional[int] = None, last: Optional[int] = None) -> list[int]:
    """Transformer layers on each pipeline stage. By default as even as possible, the remainder going to
    the last stages (how DeepSpeed's ``partition_method='type:...'`` splits them); with ``first`` or
    ``last`` (Megatron-LM's --decoder-first/last-pipeline-num-layers) those stages hold that many and
    the stages between share the rest evenly (validation checks that they can)."""
    ends = [n for n in (first, last) if n is not None]
    middle = pp - len(ends)
    if not ends:
        base, extra = divmod(num_layers, pp)
        return [base + (1 if s >= pp - extra else 0) for s in range(pp)]
    each = (num_layers - sum(ends)) // middle if middle else 0
    counts = [each] * pp
    if first is not None:
        counts[0] = first
    if last is not None:
        counts[-1] = last
    return counts


@dataclass
class TrainConfig:
    """The optimisation run: batches, schedule, precision, I/O."""

    deepspeed_config: str = flag("ds_configs/zero1.json", "DeepSpeed JSON; its 'auto' values are filled from these flags.", aliases=("--deepspeed_config",))
    micro_batch_size: int = flag(8, "Samples per rank per micro-step.")
    global_batch_size: Optional[int] = flag(None, "Samples per optimizer step over all DP ranks (default: micro x DP).")
    train_iters: int = flag(300, "Optimizer steps.")
    train_samples: Optional[int] = flag(None, "Train on this many samples instead of --train-iters (steps = samples / --global-batch-size, rounded down, as Megatron).")
    lr: float = flag(3e-3, "Peak learning rate.")
    min_lr: float = flag(0.0, "Learning rate at the end of the decay.")
    lr_warmup_iters: int = flag(0, "Linear warm-up steps, from --lr-warmup-init at the first step to --lr at step N+1 (Megatron's formula).")
    lr_warmup_fraction: Optional[float] = flag(None, "Warm-up as a fraction of the decay (of --lr-decay-iters or --lr-decay-samples), instead of --lr-warmup-iters/-samples.")
    lr_warmup_samples: int = flag(0, "With --train-samples: warm-up length in samples.")
    lr_warmup_init: float = flag(0.0, "Learning rate the warm-up starts from.")
    eval_interval: Optional[int] = flag(None, "Evaluate on the validation split every N steps (and at the end).")
    eval_iters: int = flag(100, "Global batches per evaluation (the same first batches of the validation split each time).")
    lr_decay_iters: Optional[int] = flag(None, "Step at which the decay reaches --min-lr, counted from the start, warm-up included (default: train-iters).")
    lr_decay_samples: Optional[int] = flag(None, "With --train-samples: the sample at which the decay reaches --min-lr (default: --train-samples).")
    lr_decay_style: str = flag("linear", "Decay after warm-up (WSD: constant, then a final decay; wsd is the same).", choices=("linear", "cosine", "constant", "inverse-square-root", "WSD", "wsd"))
    lr_wsd_decay_iters: Optional[int] = flag(None, "WSD: steps of the final decay (default: 10% of --lr-decay-iters).")
    lr_wsd_decay_samples: Optional[int] = flag(None, "WSD with --train-samples: samples of the final decay (default: 10% of the decay).")
    lr_wsd_decay_style: str = flag("exponential", "WSD: shape of the final decay.", choices=("exponential", "linear", "cosine", "minus_sqrt"))
    weight_decay: float = flag(0.01, "AdamW weight decay (not applied to norms and biases).")
    decoupled_lr: Optional[float] = flag(None, "Peak learning rate of the input embedding and the output layer (default: --lr), on the same schedule.")
    decoupled_min_lr: Optional[float] = flag(None, "Final learning rate of the input embedding and the output layer (default: --min-lr).")
    adam_beta1: float = flag(0.9, "AdamW beta1.")
    adam_beta2: float = flag(0.999, "AdamW beta2.")
    adam_eps: float = flag(1e-8, "AdamW epsilon.")
    clip_grad: float = flag(1.0, "Global gradient-norm clip (0 disables).")
    use_precision_aware_optimizer: bool = flag(False, "Megatron-LM's flag: store AdamW's moments in --exp-avg-dtype and --exp-avg-sq-dtype; the fp32 master weights and the update's arithmetic stay fp32 (bf16 moments: 4 bytes a parameter instead of 8).")
    exp_avg_dtype: str = flag("fp32", "With --use-precision-aware-optimizer: the dtype AdamW's first moment is stored in.", choices=("fp32", "bf16", "fp16"))
    exp_avg_sq_dtype: str = flag("fp32", "With --use-precision-aware-optimizer: the dtype AdamW's second moment is stored in.", choices=("fp32", "bf16", "fp16"))
    optimizer_impl: str = flag("auto", "AdamW implementation: torch (fused on GPU), DeepSpeed's CPU Adam for offload, or auto.", choices=("auto", "torch", "deepspeed_cpu"))
    seed: int = flag(1234, "Seed of initialisation, data order and dropout; the same seed gives the same model at any layout.")
    bf16: bool = flag(False, "bfloat16 training (fp32 master weights in the optimizer).")
    fp16: bool = flag(False, "float16 training with dynamic loss scaling.")
    save: Optional[str] = flag(None, "Directory to save checkpoints to.")
    save_interval: Optional[int] = flag(None, "Save every N steps (default: only at the end).")
    keep_last_n_checkpoints: Optional[int] = flag(None, "Delete older checkpoints, keeping this many (default: keep all).")
    load: Optional[str] = flag(None, "Directory to resume from (its latest complete checkpoint).")
    ckpt_step: Optional[int] = flag(None, "With --load: resume from global_step<N> instead of the latest.")
    finetune: bool = flag(False, "With --load: take only the model weights; fresh optimizer, LR schedule and iteration count (Megatron's --finetune).")
    load_optim: bool = flag(True, "With --load: restore the optimizer and LR-schedule state; --no-load-optim keeps the weights and the iteration and starts those afresh.")
    load_rng: bool = flag(True, "With --load: restore every rank's random streams; --no-load-rng reseeds them from --seed.")
    base_checkpoint: Optional[str] = flag(None, "Derived from --load with --quant-bits: the checkpoint folder the 4-bit base is quantized from (the one --load names, or the one a QLoRA checkpoint names as its base); a QLoRA checkpoint stores the adapters and this reference, not the base.", cli=False)
    ckpt_format: str = flag("torch_dist", "Megatron's checkpoint format; here every format is DeepSpeed's (global_step<N>/, a file per rank, reshaped on load), which is sharded as torch_dist is.", choices=("torch_dist", "torch"))
    exit_interval: Optional[int] = flag(None, "Save and exit after the iteration that is a multiple of N.")
    exit_duration_in_mins: Optional[float] = flag(None, "Save and exit once the run has trained this many minutes (ranks agree at the end of a step).")
    exit_signal_handler: bool = flag(False, "On --exit-signal finish the step, save a checkpoint on every rank and exit with code 75 (the sbatch templates requeue the job on it).")
    exit_signal: str = flag("SIGTERM", "The signal --exit-signal-handler acts on (Slurm: #SBATCH --signal=USR1@120 with --exit-signal SIGUSR1).", choices=("SIGTERM", "SIGUSR1", "SIGUSR2", "SIGINT"))
    max_bad_steps: int = flag(5, "Stop after this many consecutive skipped (overflowing or non-finite) steps; 0 never stops.")
    log_interval: int = flag(100, "Log every N steps.")
    metrics_file: Optional[str] = flag(None, "JSON-lines file: one record per logged step.")
    log_comm_interval: Optional[int] = flag(None, "Every N steps profile one training step (torch.profiler) and log its time in collective kernels, the share of the step no compute kernel overlaps (exposed), the split by process group (TP, CP, DP/ZeRO, PP, EP) and the share of the step the GPU runs kernels; with nvidia-ml-py installed also NVML's utilisation averaged over each log interval (default: off; README 'Monitoring').")
    log_grad_noise_scale: bool = flag(False, "Log the gradient noise scale B_simple of McCandlish et al. 2018 (the gradient's summed variance per sample over its squared mean), in samples, from each micro-batch's gradient norm and the step's; both of the paper's estimators are smoothed by an exponential moving average (decay 0.99 per step, bias-corrected) before the ratio. Costs a squared norm per parameter per micro-batch and one scalar all-reduce per logged step.")
    peak_tflops: Optional[float] = flag(None, "Peak TFLOP/s per device for MFU (default: the GPU's datasheet bf16 dense peak).")
    nvme_path: Optional[str] = flag(None, "Folder for ZeRO-Infinity swap files (fills 'auto' nvme_path in the JSON).")
    distributed_timeout_minutes: float = flag(10.0, "Collective timeout: a dead rank brings the others down after this long.")
    wandb_project: Optional[str] = flag(None, "Weights & Biases project: rank 0 logs every logged step there (WANDB_MODE=offline keeps it on disk).")
    wandb_name: Optional[str] = flag(None, "W&B run name (default: W&B's generated one).")
    wandb_dir: Optional[str] = flag(None, "Folder for W&B's local files (default: --save, else the working directory).")
    tensorboard_dir: Optional[str] = flag(None, "Write TensorBoard scalars (rank 0) to this folder.")
    profile_step_range: Optional[str] = flag(None, "Profile iterations A+1..B with torch.profiler, given as A,B; one Chrome trace per rank.")
    profile: bool = flag(False, "Megatron's --profile: profile iterations --profile-step-start+1 .. --profile-step-end (as --profile-step-range).")
    profile_step_start: int = flag(10, "With --profile: the iteration after which profiling starts.")
    profile_step_end: int = flag(12, "With --profile: the last profiled iteration.")
    profile_dir: str = flag("profile", "Folder for the --profile-step-range traces.")
    manual_gc: bool = flag(False, "Turn Python's automatic garbage collector off and collect at fixed steps instead (same step on every rank; Megatron's flag).")
    manual_gc_interval: int = flag(0, "With --manual-gc: collect every N steps (0: only around evaluation).")
    empty_unused_memory_level: int = flag(0, "Release the CUDA caching allocator's unused blocks (torch.cuda.empty_cache): 1 after every step and every evaluation batch, 2 also after every micro-batch's backward (PP = 1).")
    check_weight_hash_across_dp_replicas_interval: Optional[int] = flag(None, "Every N steps (and after start-up) compare a hash of the weights across the replicas that must hold the same ones (DP x CP ranks of a TP/PP shard; expert-DP ranks of an expert shard) and stop, naming the ranks and the first parameter, if they differ (Megatron's flag; default: never).")
    skip_memory_check: bool = flag(False, "Start even where the memory planner says the run cannot fit its GPU (otherwise refused at start-up, before any process group, when 85% of the planned peak is above the GPU's memory; LoRA and QLoRA runs are not checked).")
    accumulate_allreduce_grads_in_fp32: bool = flag(False, "With --bf16: accumulate the gradients over micro-batches and reduce them over ranks in fp32 (Megatron-LM's flag, on by default in its bf16 runs; off here, where DeepSpeed accumulates and reduces in bf16): DeepSpeed's data_types.grad_accum_dtype and communication_data_type fp32. ZeRO-1 then runs DeepSpeed's BF16_Optimizer, ZeRO-3 accumulates its partitions in fp32, ZeRO-2 reduces in fp32 but accumulates in bf16.")
    grad_reduce_in_bf16: bool = flag(False, "With --accumulate-allreduce-grads-in-fp32: reduce in bf16, accumulate in fp32 (Megatron's meaning); without it DeepSpeed's bf16 runs reduce in bf16 anyway.")

    def schedule_in_samples(self) -> tuple[float, float, Optional[float]]:
        """(warm-up, decay, WSD decay) lengths in samples, as Megatron's scheduler counts
        (training.py get_optimizer_param_scheduler); after ``RunConfig.validate``."""
        g = self.global_batch_size
        if self.train_samples is not None:
            decay = self.lr_decay_samples or self.train_samples
            warmup = self.lr_warmup_samples
            wsd = self.lr_wsd_decay_samples
        else:
            decay = self.lr_decay_iters * g
            warmup = self.lr_warmup_iters * g
            wsd = self.lr_wsd_decay_iters * g if self.lr_wsd_decay_iters is not None else None
        if self.lr_warmup_fraction is not None:
            warmup = self.lr_warmup_fraction * decay
        return warmup, decay, wsd


@dataclass
class DataConfig:
    """Where samples come from: Megatron-format .bin/.idx prefixes and their tokenizer."""

    mock_data: bool = flag(False, "Synthetic samples instead of --data-path (Megatron's MockGPTDataset: documents of random length whose tokens count up from 0).")
    data_path: Optional[list] = flag(None, "Data prefixes, optionally weighted ('0.3 a 0.7 b'); default: the built-in corpus.", nargs="+")
    split: str = flag("969,30,1", "Train/validation/test proportions of each prefix's documents.")
    tokenizer_type: str = flag("ByteTokenizer", "Tokenizer the data was preprocessed with (NullTokenizer: --mock-data's token ids, vocabulary --vocab-size).",
                             choices=("ByteTokenizer", "HuggingFaceTokenizer", "GPT2BPETokenizer", "Llama2Tokenizer", "NullTokenizer"))
    tokenizer_model: Optional[str] = flag(None, "HuggingFaceTokenizer: a tokenizer.json file or a local tokenizer directory; Llama2Tokenizer: a SentencePiece .model file.")
    vocab_file: Optional[str] = flag(None, "GPT2BPETokenizer: vocab.json.")
    merge_file: Optional[str] = flag(None, "GPT2BPETokenizer: merges.txt.")
    data_cache_path: Optional[str] = flag(None, "Folder for the sample-index caches (default: index-cache/ beside each prefix).")


@dataclass
class PostTrainConfig:
    """Post-training (scripts/finetune.py): which objective, and its settings."""

    task: str = flag("pretrain", "What the loop trains: next-token prediction on every token (pretrain), on the replies of chat data (sft), preference pairs (dpo), or rewards of its own completions (grpo); data for sft and dpo comes from scripts/preprocess_chat.py, for grpo from a JSONL file of prompts.",
                     choices=("pretrain", "sft", "dpo", "grpo"))
    packing: bool = flag(False, "SFT: pack several conversations into each row, positions restarting per conversation and no attention across them (variable-length flash kernels on a GPU in half precision, else an SDPA block mask).")
    dpo_beta: float = flag(0.1, "DPO: beta, the strength of the pull towards the reference model.")
    dpo_loss: str = flag("sigmoid", "DPO: the pair loss (formulas in the README): sigmoid (with --dpo-label-smoothing), ipo or hinge.",
                         choices=("sigmoid", "ipo", "hinge"))
    dpo_label_smoothing: float = flag(0.0, "DPO sigmoid loss: probability that a pair's preference is flipped (conservative DPO).")
    reference: str = flag("precompute", "DPO: reference log-probabilities computed once before training by this run's engine and layout and cached beside the data, or none (reference-free).",
                          choices=("precompute", "none"))
    ref_load: Optional[str] = flag(None, "DPO: checkpoint of the reference model (default: --load, the starting point).")
    rpo_alpha: Optional[float] = flag(None, "DPO: add this times the chosen replies' mean next-token loss (RPO; default: none).")
    # GRPO: named and defaulted as TRL 1.16.0's GRPOConfig (hybridlm.training.grpo says what follows TRL and what differs)
    num_generations: int = flag(8, "GRPO: completions sampled per prompt (G). --micro-batch-size and --global-batch-size count completions; each data-parallel replica samples all G of its prompts, so --global-batch-size / DP must be a multiple of G.")
    max_completion_length: int = flag(512, "GRPO: the most tokens a completion may have; one that reaches it without an end-of-turn or end-of-text token is truncated.")
    temperature: float = flag(1.0, "GRPO: sampling temperature of the rollouts; the loss's log-probabilities are of the logits divided by it, as TRL's.")
    top_p: float = flag(1.0, "GRPO: sample from the most likely tokens up to this probability (1: all).")
    top_k: int = flag(0, "GRPO: sample from the k most likely tokens (0: all).")
    beta: float = flag(0.0, "GRPO: weight of the KL penalty to the reference model (the starting weights; with LoRA the base, adapters off); 0 computes no reference.")
    epsilon: float = flag(0.2, "GRPO: the ratio is clipped to [1 - epsilon, 1 + --epsilon-high].")
    epsilon_high: Optional[float] = flag(None, "GRPO: upper clip of the ratio, 1 + this (DAPO's asymmetric clip; default: --epsilon).")
    num_iterations: int = flag(1, "GRPO: optimizer steps on each batch of rollouts (mu); above 1 the log-probabilities at sampling time are kept for the ratio.")
    loss_type: str = flag("dapo", "GRPO: how token terms are averaged (TRL's names): grpo (per completion, then over completions), bnpo (over the tokens of each micro-batch), dr_grpo (sum / (completions x --max-completion-length)), dapo (over the tokens of the global batch).",
                          choices=("grpo", "bnpo", "dr_grpo", "dapo"))
    scale_rewards: str = flag("group", "GRPO: advantages are rewards minus their group's mean, divided by the group's standard deviation (group), the global batch's (batch), or not divided (none).",
                              choices=("group", "batch", "none"))
    mask_truncated_completions: bool = flag(False, "GRPO: leave truncated completions (no stop token within --max-completion-length) out of the loss.")
    reward_funcs: Optional[list] = flag(None, "GRPO: reward functions: accuracy (the answer against the data's solution column, math-verify), format (--format-pattern), or user functions path/to/file.py:name or module:name.", nargs="+")
    reward_weights: Optional[list] = flag(None, "GRPO: one weight per --reward-funcs entry (default: 1 each); the reward is their weighted sum.", nargs="+")
    format_pattern: str = flag(r"^<think>(?!.*<think>)(.*?)</think>.*$", "GRPO: the regular expression the format reward matches from the completion's start (dot matches newlines).")
