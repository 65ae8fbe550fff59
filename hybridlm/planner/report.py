"""`python scripts/plan.py --model llama2-70b --gpus 64 --gpu-memory 80`: the per-GPU memory of
candidate layouts as a table, and the recommended one as a pretrain command line."""
from __future__ import annotations

import argparse
import shlex
import sys
from dataclasses import replace
from typing import Optional

from ..config import ConfigError, parse_args
from ..config import build_parser as build_run_parser
from ..presets import LAYOUTS, MODELS
from ..training.ds_config import read_ds_config
from .memory import GIB, Layout, ds_settings, total_parameters
from .search import (FRAGMENTATION, RESERVED_GIB, RESERVED_SHARE, Cluster, Plan, plan, pretrain_flags, recommend,
                     ring_traffic_bytes)

COLUMNS = ("layout", "params", "grads", "optim", "act", "act+rc", "logits", "buffers", "total", "need", "fits", "step s")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python scripts/plan.py", description="Per-GPU memory of candidate TP/PP/DP/CP/ZeRO layouts, and the fastest that fits.",
        epilog="Flags after -- change the model (any pretrain flag, e.g. -- --seq-length 8192). "
               f"A layout fits when planned peak x {1 + FRAGMENTATION:.2f} + --reserved-gib <= --gpu-memory.")
    parser.add_argument("--model", required=True, help=f"a preset: {', '.join(MODELS)}")
    parser.add_argument("--gpus", type=int, required=True, help="GPUs in the job")
    parser.add_argument("--gpu-memory", type=float, default=80.0, help="GiB per GPU (default 80)")
    parser.add_argument("--reserved-gib", type=float, default=None,
                        help=f"GiB per GPU that the planned peak does not count: CUDA context, NCCL and library workspaces "
                             f"(default {RESERVED_GIB:g}, at most {RESERVED_SHARE * 100:.0f}%% of --gpu-memory)")
    parser.add_argument("--gpus-per-node", type=int, default=8, help="TP stays within a node (default 8)")
    parser.add_argument("--micro-batch-size", type=int, default=None, help="default: the preset's layout, else 1")
    parser.add_argument("--global-batch-size", type=int, default=None, help="default: the preset's layout, else 1024")
    parser.add_argument("--fp32", action="store_true", help="plan fp32 training instead of bf16")
    parser.add_argument("--attention-backend", default="cudnn", choices=("cudnn", "flash", "te", "sdpa"),
                        help="the kernel the run will use (default cudnn: what auto picks on Hopper without flash-attn)")
    parser.add_argument("--fused-ops", action="store_true",
                        help="plan the fused RMSNorm/SwiGLU kernels (pretrain --fused-ops all; they keep less than "
                             "PyTorch's, which --fused-ops auto runs on GPUs and CPUs)")
    parser.add_argument("--allow-offload", action="store_true", help="also consider CPU offload (ZeRO-1/3)")
    parser.add_argument("--allow-ep", action="store_true", help=argparse.SUPPRESS)  # older command lines: EP is always searched
    parser.add_argument("--top", type=int, default=12, help="rows to print (default 12; the fitting layouts first)")
    return parser


def _row(p: Plan, marker: str = "") -> list[str]:
    g = p.memory.gib()
    act, act_plain = p.memory.activations / GIB, p.memory.activations_without_recompute / GIB
    rc = f"{act:.1f}" if p.layout.recompute else "-"
    return [marker + p.layout.describe(), f"{g['parameters']:.1f}", f"{g['gradients']:.1f}", f"{g['optimizer']:.1f}",
            f"{act_plain:.1f}", rc, f"{g['logits']:.1f}", f"{g['buffers']:.1f}", f"{g['total']:.1f}",
            f"{p.needed_gib:.1f}", "yes" if p.fits else "no", f"{p.step_seconds:.2f}"]


def format_table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))) for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _typed(extra: list[str]) -> set[str]:
    """The config fields the flags after -- set (not the preset's)."""
    values = vars(build_run_parser().parse_args(extra))
    return {k for k, v in values.items() if k not in ("config", "local_rank", "deepspeed")}


def _constraint(run, typed: set[str]):
    """Layout flags given after -- pin the candidates: TP, PP, EP, SP, recompute (and with selective
    recompute its modules), and a DeepSpeed JSON (its ZeRO stage, bucket sizes and offload). None when
    nothing is pinned."""
    p = run.parallel
    pinned = {"tp": p.tensor_model_parallel_size if "tensor_model_parallel_size" in typed else None,
              "pp": p.pipeline_model_parallel_size if "pipeline_model_parallel_size" in typed else None,
              "ep": p.expert_model_parallel_size if "expert_model_parallel_size" in typed else None,
              "cp": p.context_parallel_size if "context_parallel_size" in typed else None,
              "sequence_parallel": p.sequence_parallel if "sequence_parallel" in typed else None,
              "recompute": p.recompute_granularity if "recompute_granularity" in typed else None}
    pinned = {k: v for k, v in pinned.items() if v is not None}
    if "recompute_granularity" in typed:
        pinned["recompute"] = p.recompute_granularity  # None too: "no recompute" pins as well
    settings = ds_settings(read_ds_config(run.train.deepspeed_config)) if "deepspeed_config" in typed else None
    modules = tuple(p.recompute_modules or ()) if "recompute_modules" in typed else None
    if not pinned and settings is None and modules is None:
        return None

    def constrain(lay: Layout) -> Optional[Layout]:
        if any(getattr(lay, k) != v for k, v in pinned.items() if k != "sequence_parallel"):
            return None
        if "sequence_parallel" in pinned:
            lay = replace(lay, sequence_parallel=pinned["sequence_parallel"] and lay.tp > 1)
        if modules is not None and lay.recompute == "selective":
            lay = replace(lay, recompute_modules=modules)
        if settings is not None:
            if lay.zero != settings["zero"] or lay.offload_optimizer or lay.offload_params:
                return None
            lay = replace(lay, **settings)
        return lay
    return constrain


def _same(a: Layout, b) -> bool:
    return (a.tp, a.pp, a.ep, a.cp, a.zero, a.recompute) == (b.tp, b.pp, b.ep, getattr(b, "cp", 1), b.zero, b.recompute)


def main(argv: Optional[list[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    args = build_parser().parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    suggested = LAYOUTS.get(args.model)
    mbs = args.micro_batch_size or (suggested.micro_batch_size if suggested else 1)
    gbs = args.global_batch_size or (suggested.global_batch_size if suggested and suggested.global_batch_size else 1024)
    try:
        run = parse_args(["--model", args.model, *extra])
        typed = _typed(extra)
        constrain = _constraint(run, typed)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    cfg = run.model
    mbs = run.train.micro_batch_size if "micro_batch_size" in typed else mbs
    gbs = run.train.global_batch_size if "global_batch_size" in typed else gbs
    if cfg.vocab_size is None:
        cfg.vocab_size = 256  # the built-in byte tokenizer
    for flag, value in (("--gpus", args.gpus), ("--gpus-per-node", args.gpus_per_node), ("--gpu-memory", args.gpu_memory)):
        if value <= 0:
            print(f"error: {flag} must be positive, got {value:g}.", file=sys.stderr)
            return 2
    if args.reserved_gib is not None and not 0 <= args.reserved_gib < args.gpu_memory:
        print(f"error: --reserved-gib must be at least 0 and below --gpu-memory {args.gpu_memory:g}, got {args.reserved_gib:g}.",
              file=sys.stderr)
        return 2
    cluster = Cluster(args.gpus, min(args.gpus_per_node, args.gpus), args.gpu_memory, args.reserved_gib)
    plans = plan(cfg, cluster, micro_batch_size=mbs, global_batch_size=gbs, bf16=not args.fp32,
                 backend=args.attention_backend, fused=args.fused_ops, allow_offload=args.allow_offload,
                 constrain=constrain, cp_sizes=[run.parallel.context_parallel_size] if "context_parallel_size" in typed else None)
    if not plans:
        print(f"error: no layout of {args.model} divides {args.gpus} GPUs with global batch {gbs} and micro-batch {mbs}"
              f"{' and the layout flags given after --' if constrain else ''}; change --gpus, --global-batch-size or "
              "those flags.", file=sys.stderr)
        return 2
    fitting = [p for p in plans if p.fits]
    print(f"{args.model}: {total_parameters(cfg) / 1e9:.2f}B parameters (d{cfg.hidden_size}, {cfg.num_layers} layers, "
          f"{cfg.num_attention_heads} heads / {cfg.num_query_groups} groups, seq {cfg.seq_length}, vocab {cfg.vocab_size}) on "
          f"{args.gpus} GPU{'s' if args.gpus > 1 else ''} ({cluster.gpus_per_node} per node, {args.gpu_memory:g} GiB each); micro-batch {mbs}, "
          f"global batch {gbs}, {'fp32' if args.fp32 else 'bf16'}, attention {args.attention_backend}")
    print(f"Per-GPU GiB on the rank that needs the most; act = activations without recompute, act+rc = with the "
          f"layout's recompute; need = total x {1 + FRAGMENTATION:.2f} + {cluster.reserved:g} (--reserved-gib); step s = the coarse time model "
          f"(hybridlm/planner/search.py). {len(fitting)} of {len(plans)} layouts fit.\n")
    shown = plans[:args.top]
    same_cluster = suggested is not None and suggested.world_size == args.gpus
    preset_row = next((p for p in plans if same_cluster and _same(p.layout, suggested)), None)
    rows = [list(COLUMNS)] + [_row(p, "* " if p is preset_row else "") for p in shown]
    if preset_row is not None and preset_row not in shown:
        rows.append(_row(preset_row, "* "))
    print(format_table(rows))
    if preset_row is not None:
        print(f"\n* the preset's suggested layout (hybridlm/presets.py), {'fits' if preset_row.fits else 'does NOT fit'} here.")
    best = recommend(plans)
    if best is None:
        smallest = min(plans, key=lambda p: p.needed_gib)
        print(f"\nNo layout fits in {args.gpu_memory:g} GiB; the smallest needs {smallest.needed_gib:.1f} GiB "
              f"({smallest.layout.describe()}, {cluster.reserved:g} of it --reserved-gib). Use more GPUs, --allow-offload, "
              "or a shorter --seq-length.")
        return 1
    m = best.memory
    print(f"\nRecommended: {best.layout.describe()}: {m.total / GIB:.1f} GiB planned on stage {m.stage} "
          f"({'; '.join(m.notes)}), needs {best.needed_gib:.1f} of {args.gpu_memory:g} GiB; ~{best.step_seconds:.2f} s/step.")
    if best.layout.cp > 1:
        print(f"Context parallelism: each GPU holds {cfg.seq_length // best.layout.cp} of every sample's {cfg.seq_length} tokens; "
              f"ring attention sends {ring_traffic_bytes(cfg, best.layout) / GIB:.1f} GiB per GPU per step, overlapped with attention.")
    skip = {"--" + name.replace("_", "-") for name in typed} | ({"--deepspeed_config"} if "deepspeed_config" in typed else set())
    command = ["scripts/pretrain.py", "--model", args.model, *extra, *pretrain_flags(best.layout, gbs, skip=skip)]
    print("  deepspeed --hostfile HOSTFILE " + shlex.join(command) if args.gpus > cluster.gpus_per_node
          else f"  deepspeed --num_gpus {args.gpus} " + shlex.join(command))
    return 0
