"""Does a layout's loss curve track one GPU's? 200 steps twice or more (one rank, then each layout), compared.

    python benchmarks/curves.py dense|moe [--gpus 8] [--record-file R.jsonl]
    python benchmarks/curves.py dense|moe --gpus 4 [--layouts dp4-zero1,cp4-p2p] [--record-file R.jsonl]

With ``--gpus 8`` (the benchmark suite's curve-*-8gpu cases): dense is the reference block at 24
layers (1.3B) at TP=2 SP x PP=2 x DP=2, compiled; moe a Mixtral-style d1024 L16 with 8 experts
top-2 at EP=4 x DP=8; bf16, ZeRO-1. With ``--gpus 4`` (curve-*-4gpu cases): a 120M Llama-style model
(d1024 L10, GQA 16/8 heads, seq 1024) or a Mixtral-style one (d768 L8, 8 experts top-2, 240M) in bf16
against one GPU at each of the layouts in ``LAYOUTS_4GPU`` (every parallel dimension and product a
four-GPU machine holds), with the replica check on (``--check-weight-hash-across-dp-replicas-interval
50``). Without ``--gpus`` (curve-*-cpu): the built-in tiny model at the 8-GPU layouts on 8 gloo ranks of
this CPU, fp32. Same seed, data (the built-in corpus, ~0.5M byte tokens: the GPU runs see it several
times over) and global batch in every run, so the curves differ by rounding only;
``scripts/compare_runs.py``'s comparison (windows of 10 steps) decides, and the record keeps the
largest windowed gap and both curves (``python -m benchmarks render`` plots them).

Rounding alone can part two curves by more than the tolerance. On 4 H200s the MoE model passes through a fast
phase at steps 60-110 where one GPU with micro-batches of 1 sat 3.5% from one GPU with micro-batches of 2, and
DP=4 without EP 5.6%, while from the same weights every layout took one GPU's step to bf16 rounding
(benchmarks/same_weights.py --model moe). So the four-GPU cases run a rounding-only control on a second GPU beside
the reference (``ONE_GPU_LAYOUTS``: the same run with another micro-batch size) and a layout tracks when its gap
stays within the tolerance beyond the control's (``hybridlm.training.curves.allowed_gap``).
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from benchmarks.records import append, script_record  # noqa: E402
from benchmarks.runner import free_port, launcher  # noqa: E402
from hybridlm.training.curves import allowed_gap, compare, load_losses  # noqa: E402

# what, on GPUs / on CPU: (model flags, layout flags, global batch, layout words, skip, tolerance)
SHAPES = {
    ("dense", True): (["--model", "reference", "--num-layers", "24", "--torch-compile"],
                      ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--pipeline-model-parallel-size", "2"], 32,
                      "reference block d2048 L24 (1.3B), TP=2 SP x PP=2 x DP=2, ZeRO-1, bf16, --torch-compile", 10, 0.03),
    ("moe", True): (["--model", "reference", "--num-layers", "16", "--hidden-size", "1024", "--num-attention-heads", "16",
                     "--group-query-attention", "--num-query-groups", "8", "--ffn-hidden-size", "3584", "--num-experts", "8", "--moe-router-topk", "2",
                     "--moe-aux-loss-coeff", "0.02", "--micro-batch-size", "2"], ["--expert-model-parallel-size", "4"], 16,
                    "Mixtral-style d1024 L16, 8 experts top-2, EP=4 x DP=8, ZeRO-1, bf16", 10, 0.03),
    ("dense", False): (["--micro-batch-size", "2"],
                       ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--pipeline-model-parallel-size", "2"], 16,
                       "built-in tiny (d128 L4, byte vocab 257), TP=2 SP x PP=2 x DP=2, ZeRO-1, fp32", 0, 0.01),
    # a rounding difference that flips one token's top-2 choice makes the curves part by ~1%
    ("moe", False): (["--micro-batch-size", "2", "--num-experts", "8", "--moe-router-topk", "2", "--moe-aux-loss-coeff", "0.02"],
                     ["--expert-model-parallel-size", "4"], 16,
                     "built-in tiny (d128 L4) with 8 experts top-2 in every layer, EP=4 x DP=8, ZeRO-1, fp32", 0, 0.02),
}
COMMON = ["--deepspeed_config", "ds_configs/zero1.json", "--train-iters", "200", "--log-interval", "1", "--seed", "1234"]
ON_GPUS = ["--bf16", "--lr", "3e-4", "--min-lr", "3e-5", "--lr-warmup-iters", "20"]

# The four-GPU cases: one model per kind (on the built-in corpus, byte vocabulary) and every layout of four GPUs.
MODELS_4GPU = {
    "dense": (["--num-layers", "10", "--hidden-size", "1024", "--num-attention-heads", "16", "--group-query-attention",
               "--num-query-groups", "8", "--ffn-hidden-size", "2816", "--seq-length", "1024", "--micro-batch-size", "4"],
              "Llama-style d1024 L10 (120M), GQA 16/8, seq 1024, mb 4"),
    "moe": (["--num-layers", "8", "--hidden-size", "768", "--num-attention-heads", "12", "--group-query-attention",
             "--num-query-groups", "4", "--ffn-hidden-size", "2048", "--num-experts", "8", "--moe-router-topk", "2",
             "--moe-ffn-hidden-size", "1536", "--moe-aux-loss-coeff", "0.01", "--seq-length", "1024", "--micro-batch-size", "2"],
            "Mixtral-style d768 L8, 8 experts of 1536 top-2 (240M, 70M active), seq 1024, mb 2"),
}
TINY_BLOCK = ["--model", "tiny"]  # the Llama block, optimiser and byte tokenizer of the built-in run; the shape above wins
TP2, SP = ["--tensor-model-parallel-size", "2"], ["--sequence-parallel"]
LAYOUTS_4GPU = {
    "dense": {
        "dp4-zero1": ([], "DP=4 ZeRO-1"),
        "dp4-zero3": (["--deepspeed_config", "ds_configs/zero3.json"], "DP=4 ZeRO-3"),
        "tp2-sp-dp2": (TP2 + SP, "TP=2 SP x DP=2"),
        "tp2-pp2": (TP2 + ["--pipeline-model-parallel-size", "2"], "TP=2 x PP=2"),
        "pp2-dp2": (["--pipeline-model-parallel-size", "2"], "PP=2 x DP=2"),
        "cp2-p2p-dp2": (["--context-parallel-size", "2", "--cp-comm-type", "p2p"], "CP=2 p2p x DP=2"),
        "cp2-a2a-tp2": (["--context-parallel-size", "2", "--cp-comm-type", "a2a"] + TP2, "CP=2 a2a x TP=2"),
        "cp4-p2p": (["--context-parallel-size", "4", "--cp-comm-type", "p2p"], "CP=4 p2p"),
        "cp4-a2a": (["--context-parallel-size", "4", "--cp-comm-type", "a2a"], "CP=4 a2a"),
    },
    "moe": {
        "dp4": ([], "DP=4, experts replicated (no EP)"),
        "ep2-dp2": (["--expert-model-parallel-size", "2"], "EP=2 x DP=2"),
        "ep2-cp2": (["--expert-model-parallel-size", "2", "--context-parallel-size", "2"], "EP=2 x CP=2 (p2p)"),
        "ep4": (["--expert-model-parallel-size", "4"], "EP=4"),
        "ep2-tp2-sp": (["--expert-model-parallel-size", "2"] + TP2 + SP, "EP=2 x TP=2 SP"),
    },
}
# Rounding-only controls on one GPU, run beside the reference: the same sums in another order. Their gap to the
# reference is what rounding alone, amplified over 200 steps, makes of the model; a layout's gap is read beside it.
ONE_GPU_LAYOUTS = {
    "dense": {"1gpu-mb2": (["--micro-batch-size", "2"], "1 GPU, micro-batches of 2 (rounding only)")},
    "moe": {"1gpu-mb1": (["--micro-batch-size", "1"], "1 GPU, micro-batches of 1 (rounding only)")},
}
BATCH_4GPU, SKIP_4GPU, TOLERANCE_4GPU = 16, 10, 0.03
REPLICA_CHECK = ["--check-weight-hash-across-dp-replicas-interval", "50"]


def start(ranks: int, flags: list[str], metrics: str, log: str, on_cpu: bool, gpu: int | None = None) -> subprocess.Popen:
    """A training run in the background; ``gpu``: the one GPU a one-rank run sees (one-GPU runs side by side)."""
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1") if on_cpu else None
    head = launcher(ranks, free_port(), only=None if on_cpu else gpu)
    with open(log, "w") as out:
        return subprocess.Popen(head + ["scripts/pretrain.py"] + flags + ["--metrics-file", metrics],
                                cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, env=env)


def train(ranks: int, flags: list[str], metrics: str, log: str, on_cpu: bool) -> None:
    wait(start(ranks, flags, metrics, log, on_cpu))


def wait(proc: subprocess.Popen) -> None:
    if proc.wait():
        raise subprocess.CalledProcessError(proc.returncode, proc.args)


def four_gpus(what: str, layouts: list[str], work: str, record_file: str | None, fp32_grads: bool = False) -> int:
    """One GPU, then each layout on four; one record per layout (its gap, both curves); 1 if any diverges."""
    model, words = MODELS_4GPU[what]
    flags = COMMON + TINY_BLOCK + model + ON_GPUS + REPLICA_CHECK + ["--global-batch-size", str(BATCH_4GPU)]
    if fp32_grads:  # DeepSpeed's grad_accum_dtype and communication_data_type fp32 (hybridlm.training.ds_config)
        flags += ["--accumulate-allreduce-grads-in-fp32"]
        words += ", gradients accumulated and reduced in fp32"
    one = os.path.join(work, "one.jsonl")
    controls = [n for n in layouts if n in ONE_GPU_LAYOUTS[what]]
    beside = {name: start(1, flags + ONE_GPU_LAYOUTS[what][name][0], os.path.join(work, f"{name}.jsonl"),
                          os.path.join(work, f"{name}.log"), on_cpu=False, gpu=gpu) for gpu, name in enumerate(controls, start=1)}
    wait(start(1, flags, one, os.path.join(work, "one.log"), on_cpu=False, gpu=0 if controls else None))
    reference, failures, rounding = load_losses(one), 0, None
    for name in controls + [n for n in layouts if n not in controls]:
        layout, layout_words = {**LAYOUTS_4GPU[what], **ONE_GPU_LAYOUTS[what]}[name]
        metrics = os.path.join(work, f"{name}.jsonl")
        label = f"{words}: {layout_words} vs 1 GPU, bf16, gbs {BATCH_4GPU}, 200 steps, replica check every 50"
        argv = [what, "--gpus", "4", "--layouts", name] + (["--fp32-grads"] if fp32_grads else [])
        try:
            wait(beside[name]) if name in beside else train(4, flags + layout, metrics, os.path.join(work, f"{name}.log"), on_cpu=False)
        except subprocess.CalledProcessError as e:
            failures += 1
            print(f"{layout_words}: the run failed (exit {e.returncode}); its log: {os.path.join(work, name + '.log')}", flush=True)
            if record_file:
                append(record_file, script_record("python benchmarks/curves.py", argv, label, {}, status="failed", error=f"exit {e.returncode}"))
            continue
        curve = load_losses(metrics)
        result = compare(reference, curve, window=10, skip=SKIP_4GPU)
        gap = f"{100 * result.max_gap:.2f}% (window 10, after step {SKIP_4GPU})"
        if name in controls:  # what rounding alone makes of one GPU's run: the band the layouts are judged beyond
            rounding = max(rounding or 0.0, result.max_gap)
            verdict, row = "rounding-only control", {}
            print(f"{words}, {layout_words}: largest windowed loss gap {100 * result.max_gap:.2f}% over 200 steps against 1 GPU "
                  f"(steps {result.worst_window[0]}-{result.worst_window[1]}): what rounding alone does", flush=True)
        else:
            allowed = allowed_gap(TOLERANCE_4GPU, rounding)
            tracks = result.max_gap <= allowed
            failures += not tracks
            verdict = "tracks" if tracks else "DIVERGES"
            band = f"tolerance {100 * TOLERANCE_4GPU:.0f}%" + (f" beyond the rounding-only control's {100 * rounding:.2f}%" if rounding else "")
            row = {} if tracks else dict(status="failed", error=f"diverges: windowed gap {gap}, {band}")
            print(f"{words}, {layout_words}: largest windowed loss gap {100 * result.max_gap:.2f}% over 200 steps against 1 GPU "
                  f"(steps {result.worst_window[0]}-{result.worst_window[1]}; {band}): {verdict}", flush=True)
        if record_file:
            shown = {"max windowed loss gap": gap, "verdict": verdict}
            if rounding is not None and name not in controls:
                shown["rounding-only control's gap"] = f"{100 * rounding:.2f}%"
            append(record_file, script_record(
                "python benchmarks/curves.py", argv, label, shown, **row,
                curve={"layout": name, "reference": [reference[i] for i in sorted(reference)], "losses": [curve[i] for i in sorted(curve)]}))
    return 1 if failures else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=("dense", "moe"))
    parser.add_argument("--gpus", type=int, default=0, help="8 or 4: the GPU cases; 0: 8 gloo ranks on this CPU")
    parser.add_argument("--layouts", default=None, help=f"with --gpus 4: a comma list of {', '.join(n for d in (ONE_GPU_LAYOUTS, LAYOUTS_4GPU) for v in d.values() for n in v)}"
                        " (default: all of the model's)")
    parser.add_argument("--fp32-grads", action="store_true", help="with --gpus 4: --accumulate-allreduce-grads-in-fp32, the bf16 runs' "
                        "gradients in fp32 (Megatron-LM's default) instead of DeepSpeed's bf16")
    parser.add_argument("--record-file", default=None)
    parser.add_argument("--workdir", default=None, help="where the metrics files and logs go (default: a temporary folder)")
    args = parser.parse_args()
    work = args.workdir or tempfile.mkdtemp(prefix=f"curves_{args.what}_")
    if args.gpus == 4:
        known = {**ONE_GPU_LAYOUTS[args.what], **LAYOUTS_4GPU[args.what]}
        layouts = args.layouts.split(",") if args.layouts else list(known)
        unknown = [n for n in layouts if n not in known]
        if unknown:
            parser.error(f"--layouts: {unknown[0]!r} is not a four-GPU {args.what} layout ({', '.join(known)})")
        return four_gpus(args.what, layouts, work, args.record_file, args.fp32_grads)
    if args.gpus not in (0, 8):
        parser.error("--gpus takes 8 or 4 (0: the CPU case)")
    model, layout, batch, words, skip, tolerance = SHAPES[(args.what, args.gpus > 0)]
    flags = COMMON + model + (ON_GPUS if args.gpus else []) + ["--global-batch-size", str(batch)]
    one, many = os.path.join(work, "one.jsonl"), os.path.join(work, "many.jsonl")
    train(1, flags, one, os.path.join(work, "one.log"), on_cpu=not args.gpus)
    train(args.gpus or 8, flags + layout, many, os.path.join(work, "many.log"), on_cpu=not args.gpus)
    result = compare(load_losses(one), load_losses(many), window=10, skip=skip)
    tracks = result.max_gap <= tolerance
    print(f"{words}: largest windowed loss gap {100 * result.max_gap:.2f}% over 200 steps against 1 rank "
          f"(steps {result.worst_window[0]}-{result.worst_window[1]}; tolerance {100 * tolerance:.0f}%): "
          f"{'tracks' if tracks else 'DIVERGES'}", flush=True)
    if args.record_file:
        append(args.record_file, script_record("python benchmarks/curves.py", sys.argv[1:], f"{words}, gbs {batch}, 200 steps vs 1 rank",
                                               {"max windowed loss gap": f"{100 * result.max_gap:.2f}% (window 10, after step {skip})"}))
    return 0 if tracks else 1


if __name__ == "__main__":
    sys.exit(main())
