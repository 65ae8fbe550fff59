"""What each Megatron-LM flag does here: one table.

Megatron-LM's flags that are hybridlm settings keep Megatron's names and defaults and are
defined once, as config fields (``--num-layers``, ``--overlap-grad-reduce`` ...). This module
holds everything else a Megatron launch script may pass, so "what does this flag do here" has
one answer:

  ALIASES   another spelling of one of our flags: an older spelling the guides still use, or
            Megatron's negative form (``--disable-bias-linear``)
  VALUES    Megatron's name for a value of one of our flags (``--attention-backend fused``)
  IGNORED   accepted, and changes nothing here (the help and the run log say why); some accept
            only the values that change nothing (``--dataloader-type single``)
  REFUSED   refused before any process group with one sentence naming what to use instead

and ``check``, the rules for Megatron fields whose meaning here is a mapping (ZeRO for the
distributed optimizer, DeepSpeed's overlap_comm for ``--overlap-grad-reduce``, ...): each
either refuses one combination in one sentence or adds a line to the run log.

Sources: megatron/training/arguments.py and megatron/training/config/*.py of Megatron-LM.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any, Callable, Optional

from .fields import ConfigError

_VALUE = object()  # an alias that takes the flag's value instead of setting a constant


@dataclass(frozen=True)
class Alias:
    flag: str
    field: str
    const: Any = _VALUE
    why: str = ""

    @property
    def meaning(self) -> str:
        target = "--" + self.field.replace("_", "-")
        if self.const is _VALUE:
            return f"same as {target}"
        if isinstance(self.const, bool):
            return f"same as {target if self.const else '--no-' + target[2:]}"
        return f"same as {target} {self.const}"


@dataclass(frozen=True)
class Ignored:
    flag: str
    why: str
    takes_value: bool = False
    accepts: Optional[tuple] = None  # the values that change nothing; others are refused
    refusal: str = ""  # the sentence for a value outside ``accepts``


@dataclass(frozen=True)
class Refused:
    flag: str
    why: str  # completes "<flag> ...": says why, and what to use instead
    takes_value: bool = False


ALIASES = (
    Alias("--disable-bias-linear", "add_bias_linear", False, "Megatron's spelling"),
    Alias("--fp8-hybrid", "fp8_format", "hybrid", "Megatron-LM before 2023-08"),
    Alias("--recompute-activations", "recompute_granularity", "selective", "Megatron's shorthand"),
    Alias("--use-flash-attn", "attention_backend", "flash", "Megatron-LM's older flag"),
    Alias("--use-rotary-position-embeddings", "position_embedding_type", "rope", "deprecated in Megatron-LM"),
    Alias("--wandb-exp-name", "wandb_name", why="Megatron's name"),
    Alias("--distribute-saved-activations", "partition_activations", True, "Megatron's name"),
    Alias("--profile-output-path", "profile_dir", why="Megatron-DeepSpeed's name"),
)

VALUES = {
    # megatron/training/arguments.py --attention-backend: fused is Transformer Engine's cuDNN
    # FusedAttention; unfused and local are plain PyTorch attention.
    "attention_backend": {"fused": "cudnn", "unfused": "sdpa", "local": "sdpa"},
    # Megatron's tensorwise recipe is Transformer Engine's Float8CurrentScaling.
    "fp8_recipe": {"tensorwise": "current"},
}

IGNORED = (
    Ignored("--use-mcore-models", "Megatron-LM ignores it too (it has only the core models now); hybridlm has one model."),
    Ignored("--no-masked-softmax-fusion", "hybridlm's attention kernels apply the causal mask themselves; there is no "
                                          "separate fused softmax to switch off."),
    Ignored("--no-async-tensor-model-parallel-allreduce", "hybridlm's tensor-parallel all-reduces are synchronous already."),
    Ignored("--calculate-per-token-loss", "hybridlm's loss is already the mean over every loss token of the global batch."),
    Ignored("--cross-entropy-loss-fusion", "a kernel choice; the loss is the same (--torch-compile fuses it at TP = 1)."),
    Ignored("--no-create-attention-mask-in-dataloader", "hybridlm never builds an attention mask: its kernels are causal."),
    Ignored("--no-mmap-bin-files", "reading the .bin files with or without mmap gives the same tokens."),
    Ignored("--num-workers", "hybridlm reads samples in the training process.", takes_value=True),
    Ignored("--log-throughput", "hybridlm always logs tokens/s, TFLOP/s and MFU per GPU."),
    Ignored("--use-pytorch-profiler", "hybridlm's --profile always uses torch.profiler."),
    Ignored("--tiktoken-pattern", "Megatron reads it only for --tokenizer-type TikTokenizer, which hybridlm does not have.",
            takes_value=True),
    Ignored("--dataloader-type", "single, Megatron's default, is how hybridlm reads samples.", takes_value=True,
            accepts=("single",), refusal="hybridlm reads samples as Megatron's single sampler does; drop it."),
    Ignored("--no-position-embedding", "with --position-embedding-type rope there is no position table to drop."),
)

REFUSED = (
    Refused("--num-layers-per-virtual-pipeline-stage", "asks for the interleaved pipeline schedule; DeepSpeed's pipeline "
            "engine runs 1F1B only, so drop it and use more micro-batches per step (--global-batch-size) to shrink the bubble.",
            takes_value=True),
    Refused("--num-virtual-stages-per-pipeline-rank", "asks for the interleaved pipeline schedule; DeepSpeed's pipeline engine "
            "runs 1F1B only, so drop it.", takes_value=True),
    Refused("--tp-comm-overlap", "needs Transformer Engine's userbuffer communication; hybridlm's tensor-parallel "
            "collectives are its own and not overlapped with GEMMs, so drop it."),
    Refused("--step-batch-size-schedule", "(a batch-size ramp) is not implemented; use a constant --global-batch-size.",
            takes_value=True),
    Refused("--rampup-batch-size", "(a batch-size ramp) is not implemented; use a constant --global-batch-size.",
            takes_value=True),
    Refused("--data-parallel-size", "is derived here as in Megatron-LM: world size / (TP x PP x CP); drop it.", takes_value=True),
    Refused("--gradient-accumulation-steps", "is derived from --global-batch-size / (--micro-batch-size x DP); "
            "give --global-batch-size instead.", takes_value=True),
    Refused("--use-fused-kernels", "is not a Megatron-LM flag; hybridlm's fused kernels are --fused-ops all."),
    Refused("--use-torch-compile", "is not a Megatron-LM flag; hybridlm's is --torch-compile."),
)

# tools/preprocess_data.py's flags that scripts/preprocess_data.py has no field for
PREPROCESS_IGNORED = (
    Ignored("--log-interval", "the progress line updates by time, not every N documents.", takes_value=True),
    Ignored("--keep-sequential-samples", "documents are always written in input order."),
    Ignored("--partitions", "--workers parallelise the encoding, and documents are written in input order, which "
            "Megatron-LM's partitions keep only with --keep-sequential-samples.", takes_value=True),
)
PREPROCESS_REFUSED = (
    Refused("--split-sentences", "prepares BERT sentence pairs; hybridlm trains GPT models on whole documents, so drop it."),
    Refused("--keep-newlines", "acts only with --split-sentences, which hybridlm does not do; drop it."),
    Refused("--lang", "names the language for --split-sentences, which hybridlm does not do; drop it.", takes_value=True),
    Refused("--find-optimal-num-workers", "is not implemented; set --workers."),
    Refused("--workers-to-check", "belongs to --find-optimal-num-workers, which is not implemented; set --workers.",
            takes_value=True),
    Refused("--max-documents", "belongs to --find-optimal-num-workers, which is not implemented; drop it.", takes_value=True),
)


def add_to_parser(parser: argparse.ArgumentParser, aliases=ALIASES, ignored=IGNORED, refused=REFUSED) -> None:
    """Every flag of the table (by default pretraining's), with help that says what it does here."""
    for alias in aliases:
        help = f"{alias.meaning} ({alias.why})." if alias.why else f"{alias.meaning}."
        if alias.const is _VALUE:
            parser.add_argument(alias.flag, dest=alias.field, default=argparse.SUPPRESS, help=help)
        else:
            parser.add_argument(alias.flag, dest=alias.field, action="store_const", const=alias.const,
                                default=argparse.SUPPRESS, help=help)
    for entry in ignored:
        kind = dict(nargs=1) if entry.takes_value else dict(action="store_const", const=[])
        parser.add_argument(entry.flag, dest=_dest(entry.flag), default=argparse.SUPPRESS,
                            help=f"Accepted and ignored: {entry.why}", **kind)
    for entry in refused:
        kind = dict(nargs="*") if entry.takes_value else dict(action="store_const", const=[])
        parser.add_argument(entry.flag, dest=_dest(entry.flag), default=argparse.SUPPRESS,
                            help=f"Refused: {entry.flag} {entry.why}", **kind)


def _dest(flag: str) -> str:
    return "megatron:" + flag


_CONDITIONS = {  # flag -> (parsed values, its own value) -> a refusal when it would change something here
    "--no-position-embedding": lambda values, given: None if values.get("position_embedding_type") == "rope" else (
        "--no-position-embedding drops the learned position table, which Megatron-LM refuses too; use "
        "--position-embedding-type rope."),
    # Megatron's partitions without --keep-sequential-samples deal the input lines out round-robin, so
    # the documents (and with them the train/valid/test split) come out in another order
    "--partitions": lambda values, given: None if given[0] == "1" or _dest("--keep-sequential-samples") in values else (
        f"--partitions {given[0]} without --keep-sequential-samples reorders the documents round-robin in Megatron-LM; "
        "hybridlm keeps input order, so add --keep-sequential-samples (the same order) or drop --partitions."),
}


def value_choices(field: str, choices) -> Optional[tuple]:
    """A field's choices with Megatron's names for its values added."""
    return None if choices is None else tuple(choices) + tuple(VALUES.get(field, {}))


def translate(values: dict, ignored=IGNORED, refused=REFUSED) -> list[str]:
    """Apply the table to parsed flags (in place): refusals raise ConfigError, Megatron's value
    names become ours, ignored flags leave a log line. Returns the log lines."""
    notes = []
    for entry in refused:
        if _dest(entry.flag) in values:
            raise ConfigError(f"{entry.flag} {entry.why}")
    for entry in ignored:
        given = values.get(_dest(entry.flag))
        if given is None:
            continue
        if entry.accepts is not None and given and given[0] not in entry.accepts:
            raise ConfigError(f"{entry.flag} {given[0]}: {entry.refusal}")
        refusal = _CONDITIONS.get(entry.flag, lambda values, given: None)(values, given)
        if refusal:
            raise ConfigError(refusal)
        notes.append(f"{entry.flag}: accepted and ignored: {entry.why}")
    for entry in ignored:
        values.pop(_dest(entry.flag), None)
    for name, names in VALUES.items():
        if values.get(name) in names:
            ours = names[values[name]]
            notes.append(f"--{name.replace('_', '-')} {values[name]}: Megatron's name for {ours} here")
            values[name] = ours
    return notes


# ---------------------------------------------------------------- mapped fields

def check(cfg) -> list[str]:
    """Megatron fields whose meaning here is a mapping: refuse what cannot hold, log what maps.
    Runs in ``RunConfig.validate`` (no process group yet); returns the log lines."""
    notes = []
    for rule in _RULES:
        line = rule(cfg)
        if line:
            notes.append(line)
    return notes


def _distributed_optimizer(cfg) -> Optional[str]:
    p = cfg.parallel
    if not p.use_distributed_optimizer:
        return None
    if p.zero_stage == 0:
        raise ConfigError(f"--use-distributed-optimizer asks for optimizer state sharded over DP, but "
                          f"{cfg.train.deepspeed_config} has ZeRO stage 0; use ds_configs/zero1.json.")
    return f"--use-distributed-optimizer: optimizer state sharded over DP by DeepSpeed's ZeRO stage {p.zero_stage}"


def _overlap_grad_reduce(cfg) -> Optional[str]:
    p = cfg.parallel
    if not (p.overlap_grad_reduce and "overlap_grad_reduce" in cfg.explicit):
        return None
    if p.zero_stage == 0:
        return "--overlap-grad-reduce: no effect with ZeRO stage 0 (DeepSpeed overlaps the reduction only under ZeRO)"
    if p.pipeline_model_parallel_size > 1:
        return ("--overlap-grad-reduce: no effect with --pipeline-model-parallel-size > 1 (DeepSpeed's pipeline engine "
                "turns overlap_comm off)")
    return "--overlap-grad-reduce: DeepSpeed's overlap_comm reduces gradient buckets during backward"


def _overlap_param_gather(cfg) -> Optional[str]:
    p = cfg.parallel
    if not p.overlap_param_gather:
        return None
    if not (p.use_distributed_optimizer and p.overlap_grad_reduce):  # arguments.py asserts the same
        raise ConfigError("--overlap-param-gather needs --use-distributed-optimizer and --overlap-grad-reduce, as in Megatron-LM.")
    if p.zero_stage == 3:
        return "--overlap-param-gather: ZeRO-3 prefetches the next layers' parameters during forward"
    return (f"--overlap-param-gather: no effect with ZeRO stage {p.zero_stage} (DeepSpeed all-gathers the updated "
            "parameters inside the optimizer step)")


def _rotary_percent(cfg) -> Optional[str]:
    if cfg.model.rotary_percent != 1.0:
        raise ConfigError(f"--rotary-percent {cfg.model.rotary_percent}: hybridlm applies RoPE to the whole head "
                          "dimension; use 1.0.")
    return None


def _dispatcher(cfg) -> Optional[str]:
    kind = cfg.model.moe_token_dispatcher_type
    if kind == "flex":
        raise ConfigError("--moe-token-dispatcher-type flex selects Megatron's DeepEP/HybridEP dispatch backends, "
                          "which hybridlm does not have; use alltoall.")
    if cfg.model.num_experts is not None and kind == "allgather" and "moe_token_dispatcher_type" in cfg.explicit:
        return "--moe-token-dispatcher-type allgather: tokens travel by all-to-all here; routing and results are the same"
    return None


def _fp8_param_gather(cfg) -> Optional[str]:
    if not cfg.model.fp8_param_gather:
        return None
    if not cfg.model.fp8_format:
        raise ConfigError("--fp8-param-gather needs --fp8-format, as in Megatron-LM.")
    return ("--fp8-param-gather: the GEMMs get FP8 weights cast from the bf16 ones each step (Megatron keeps FP8 "
            "primary weights); memory and all-gather traffic are those of bf16 weights")


def _gradient_precision(cfg) -> Optional[str]:
    """--accumulate-allreduce-grads-in-fp32 and --grad-reduce-in-bf16 (Megatron: fp32 accumulation and reduction by
    default with --bf16, the reduction in bf16 with the latter); the DeepSpeed keys are set in ``finalize_ds_config``."""
    t = cfg.train
    if t.grad_reduce_in_bf16 and not t.bf16:
        raise ConfigError("--grad-reduce-in-bf16 needs --bf16.")
    if t.accumulate_allreduce_grads_in_fp32 and t.fp16:
        raise ConfigError("--accumulate-allreduce-grads-in-fp32 cannot be combined with --fp16: DeepSpeed keeps fp16 "
                          "gradients in fp16 (use --bf16).")
    if t.accumulate_allreduce_grads_in_fp32 and not t.bf16:
        return "--accumulate-allreduce-grads-in-fp32: fp32 gradients are accumulated and reduced in fp32 anyway"
    if t.accumulate_allreduce_grads_in_fp32 and cfg.model.gradient_accumulation_fusion:
        raise ConfigError("--accumulate-allreduce-grads-in-fp32 cannot be combined with --gradient-accumulation-fusion: "
                          "DeepSpeed then accumulates into fp32 buffers of its own, which Transformer Engine's GEMMs do not write.")
    if t.grad_reduce_in_bf16 and not t.accumulate_allreduce_grads_in_fp32:
        return "--grad-reduce-in-bf16: DeepSpeed's bf16 gradients are reduced in bf16"
    return None


def _precision_aware_optimizer(cfg) -> Optional[str]:
    """--use-precision-aware-optimizer with --exp-avg-dtype / --exp-avg-sq-dtype (Megatron: the moments' storage
    dtypes, fp32 unless the flag is given); hybridlm.training.moment_adamw keeps them."""
    t = cfg.train
    narrowed = [f"--{name.replace('_', '-')} {getattr(t, name)}" for name in ("exp_avg_dtype", "exp_avg_sq_dtype") if getattr(t, name) != "fp32"]
    if narrowed and not t.use_precision_aware_optimizer:
        raise ConfigError(f"{narrowed[0]} needs --use-precision-aware-optimizer, as in Megatron-LM.")
    if t.use_precision_aware_optimizer and not (t.bf16 or t.fp16):
        raise ConfigError("--use-precision-aware-optimizer needs --bf16 or --fp16: it narrows the moments beside fp32 master "
                          "weights, which an fp32 run does not keep.")
    if t.use_precision_aware_optimizer and not narrowed:
        return "--use-precision-aware-optimizer: the moments stay fp32 (--exp-avg-dtype / --exp-avg-sq-dtype fp32)"
    return None


def _ckpt_format(cfg) -> Optional[str]:
    if "ckpt_format" not in cfg.explicit:
        return None
    return (f"--ckpt-format {cfg.train.ckpt_format}: checkpoints are DeepSpeed's (global_step<N>/, one file per rank, "
            "reshaped to another layout on load), not Megatron-LM's; scripts/convert_to_hf.py exports them")


def _profile(cfg) -> Optional[str]:
    t = cfg.train
    if not t.profile:
        return None
    if t.profile_step_range is not None:
        raise ConfigError("--profile cannot be combined with --profile-step-range; give one of them.")
    t.profile_step_range = f"{t.profile_step_start},{t.profile_step_end}"
    return (f"--profile: torch.profiler traces of iterations {t.profile_step_start + 1}..{t.profile_step_end} in "
            f"{t.profile_dir}/ (Megatron's default profiler is nsys)")


_RULES: tuple[Callable, ...] = (_distributed_optimizer, _overlap_grad_reduce, _overlap_param_gather, _rotary_percent,
                                 _dispatcher, _fp8_param_gather, _gradient_precision, _precision_aware_optimizer,
                                 _ckpt_format, _profile)


def markdown() -> str:
    """The README's table of the Megatron-LM flags that are not hybridlm fields."""
    rows = ["| Megatron-LM flag | here |", "|---|---|"]
    rows += [f"| `{a.flag}` | {a.meaning}{f' ({a.why})' if a.why else ''} |" for a in ALIASES]
    for name, names in VALUES.items():
        rows += [f"| `--{name.replace('_', '-')} {theirs}` | same as `--{name.replace('_', '-')} {ours}` |"
                 for theirs, ours in names.items()]
    rows += [f"| `{e.flag}` | accepted, ignored: {e.why} |" for e in IGNORED]
    rows += [f"| `{e.flag}` | refused: {e.flag} {e.why} |" for e in REFUSED]
    rows += [f"| `{e.flag}` (preprocess_data.py) | accepted, ignored: {e.why} |" for e in PREPROCESS_IGNORED]
    rows += [f"| `{e.flag}` (preprocess_data.py) | refused: {e.flag} {e.why} |" for e in PREPROCESS_REFUSED]
    return "\n".join(rows)
