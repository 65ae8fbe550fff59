"""Does a layout's loss curve track one GPU's? 200 steps twice (one rank, then the layout), compared.

    python benchmarks/curves.py dense|moe [--gpus 8] [--record-file R.jsonl]

With ``--gpus 8`` (the benchmark suite's curve-*-8gpu cases): dense is the reference block at 24
layers (1.3B) at TP=2 SP x PP=2 x DP=2, compiled; moe a Mixtral-style d1024 L16 with 8 experts
top-2 at EP=4 x DP=8; bf16, ZeRO-1. Without it (curve-*-cpu): the built-in tiny model at the same
layouts on 8 gloo ranks of this CPU, fp32. Same seed, data (the built-in corpus) and global batch
in both runs, so the curves differ by rounding only; ``scripts/compare_runs.py``'s comparison
(windows of 10 steps) decides, and the record keeps the largest windowed gap.
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
from benchmarks.runner import launcher  # noqa: E402
from hybridlm.training.curves import compare, load_losses  # noqa: E402

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


def train(ranks: int, flags: list[str], metrics: str, log: str, on_cpu: bool) -> None:
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1") if on_cpu else None
    with open(log, "w") as out:
        subprocess.run(launcher(ranks, 29400 + ranks) + ["scripts/pretrain.py"] + flags + ["--metrics-file", metrics],
                       cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, env=env, check=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=("dense", "moe"))
    parser.add_argument("--gpus", type=int, default=0, help="8: the GPU cases; 0: 8 gloo ranks on this CPU")
    parser.add_argument("--record-file", default=None)
    parser.add_argument("--workdir", default=None, help="where the metrics files and logs go (default: a temporary folder)")
    args = parser.parse_args()
    model, layout, batch, words, skip, tolerance = SHAPES[(args.what, args.gpus > 0)]
    flags = COMMON + model + (ON_GPUS if args.gpus else []) + ["--global-batch-size", str(batch)]
    work = args.workdir or tempfile.mkdtemp(prefix=f"curves_{args.what}_")
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
