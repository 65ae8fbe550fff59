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
    expert_model_parallel_size: int = flag(1, "EP: ranks that split the experts (carved out of DP x CP).")
    context_parallel_size: int = flag(1, "CP: ranks that split each sample's sequence (long context); to DeepSpeed they are data-parallel replicas.")
    cp_comm_type: str = flag("p2p", "How CP ranks attend over the whole sequence: p2p (ring attention, K/V passed around), a2a (all-to-all to heads, Ulysses), allgather (K/V gathered).",
                             choices=("p2p", "a2a", "allgather"))
    sequence_parallel: bool = flag(False, "Megatron sequence parallelism: shard norms/dropout activations over TP.")
    recompute_granularity: Optional[str] = flag(None, "Activation recompute: whole layers or only core attention.", choices=("full", "selective"))
    recompute_num_layers: Optional[int] = flag(None, "With full recompute: recompute the first N layers of each stage (default: all).")
    partition_activations: Optional[bool] = flag(None, "Split checkpointed activations over TP (default: on with TP>1 and full recompute, off with SP).")
    zero_stage: int = flag(0, "Derived from the DeepSpeed JSON.", cli=False)
    data_parallel_size: int = flag(1, "Derived: world / (TP x PP x CP).", cli=False)


@dataclass
class TrainConfig:
    """The optimisation run: batches, schedule, precision, I/O."""

    deepspeed_config: str = flag("ds_configs/zero1.json", "DeepSpeed JSON; its 'auto' values are filled from these flags.", aliases=("--deepspeed-config",))
    micro_batch_size: int = flag(8, "Samples per rank per micro-step.")
    global_batch_size: Optional[int] = flag(None, "Samples per optimizer step over all DP ranks (default: micro x DP).")
    train_iters: int = flag(300, "Optimizer steps.")
    lr: float = flag(3e-3, "Peak learning rate.")
    min_lr: float = flag(3e-4, "Learning rate at the end of the decay.")
    lr_warmup_iters: int = flag(20, "Linear warm-up steps.")
    eval_interval: Optional[int] = flag(None, "Evaluate on the validation split every N steps (and at the end).")
    eval_iters: int = flag(10, "Global batches per evaluation (the same first batches of the validation split each time).")
    lr_decay_iters: Optional[int] = flag(None, "Steps of decay after warm-up (default: train-iters).")
    lr_decay_style: str = flag("cosine", "Decay after warm-up (wsd: constant, then a final decay).", choices=("cosine", "linear", "constant", "wsd"))
    lr_wsd_decay_iters: Optional[int] = flag(None, "WSD: steps of the final decay (default: 10% of --lr-decay-iters).")
    lr_wsd_decay_style: str = flag("linear", "WSD: shape of the final decay.", choices=("linear", "cosine", "exponential", "minus_sqrt"))
    weight_decay: float = flag(0.1, "AdamW weight decay (not applied to norms and biases).")
    adam_beta1: float = flag(0.9, "AdamW beta1.")
    adam_beta2: float = flag(0.95, "AdamW beta2.")
    adam_eps: float = flag(1e-8, "AdamW epsilon.")
    clip_grad: float = flag(1.0, "Global gradient-norm clip (0 disables).")
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
    exit_signal_handler: bool = flag(False, "On --exit-signal finish the step, save a checkpoint on every rank and exit with code 75 (the sbatch templates requeue the job on it).")
    exit_signal: str = flag("SIGUSR1", "The signal --exit-signal-handler acts on (Slurm: #SBATCH --signal=USR1@120).", choices=("SIGUSR1", "SIGUSR2", "SIGTERM", "SIGINT"))
    max_bad_steps: int = flag(5, "Stop after this many consecutive skipped (overflowing or non-finite) steps; 0 never stops.")
    log_interval: int = flag(10, "Log every N steps.")
    metrics_file: Optional[str] = flag(None, "JSON-lines file: one record per logged step.")
    peak_tflops: Optional[float] = flag(None, "Peak TFLOP/s per device for MFU (default: the GPU's datasheet bf16 dense peak).")
    nvme_path: Optional[str] = flag(None, "Folder for ZeRO-Infinity swap files (fills 'auto' nvme_path in the JSON).")
    distributed_timeout_minutes: float = flag(10.0, "Collective timeout: a dead rank brings the others down after this long.")
    wandb_project: Optional[str] = flag(None, "Weights & Biases project: rank 0 logs every logged step there (WANDB_MODE=offline keeps it on disk).")
    wandb_name: Optional[str] = flag(None, "W&B run name (default: W&B's generated one).")
    wandb_dir: Optional[str] = flag(None, "Folder for W&B's local files (default: --save, else the working directory).")
    tensorboard_dir: Optional[str] = flag(None, "Write TensorBoard scalars (rank 0) to this folder.")
    profile_step_range: Optional[str] = flag(None, "Profile iterations A+1..B with torch.profiler, given as A,B; one Chrome trace per rank.")
    profile_dir: str = flag("profile", "Folder for the --profile-step-range traces.")
    manual_gc: bool = flag(False, "Turn Python's automatic garbage collector off and collect at fixed steps instead (same step on every rank; Megatron's flag).")
    manual_gc_interval: int = flag(0, "With --manual-gc: collect every N steps (0: only around evaluation).")


@dataclass
class DataConfig:
    """Where samples come from: Megatron-format .bin/.idx prefixes and their tokenizer."""

    data_path: Optional[list] = flag(None, "Data prefixes, optionally weighted ('0.3 a 0.7 b'); default: the built-in corpus.", nargs="+")
    split: str = flag("969,30,1", "Train/validation/test proportions of each prefix's documents.")
    tokenizer_type: str = flag("ByteTokenizer", "Tokenizer the data was preprocessed with.",
                             choices=("ByteTokenizer", "HuggingFaceTokenizer", "GPT2BPETokenizer"))
    tokenizer_model: Optional[str] = flag(None, "HuggingFaceTokenizer: a tokenizer.json file or a local tokenizer directory.")
    vocab_file: Optional[str] = flag(None, "GPT2BPETokenizer: vocab.json.")
    merge_file: Optional[str] = flag(None, "GPT2BPETokenizer: merges.txt.")
    data_cache_path: Optional[str] = flag(None, "Folder for the sample-index caches (default: index-cache/ beside each prefix).")

