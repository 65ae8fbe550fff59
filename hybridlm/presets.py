"""Named model shapes (``--model NAME``) and the parallel layout each is meant to run with.

A shape is a flag list, so a preset is exactly what a user could type: ``--model llama2-7b``
puts these flags in front of the user's own, and the user's win. A layout says where a
shape runs (nodes x GPUs per node, GPU memory) and how it is split there (TP, PP, EP,
ZeRO, recompute, batch sizes); the sbatch templates launch with it
(``python -m hybridlm.presets --layout-flags NAME``) and the memory planner
(``scripts/plan.py``) checks it fits. This module imports nothing from the package, so the
config module can read it.
"""
from __future__ import annotations

import argparse
import shlex
import sys
from dataclasses import dataclass
from typing import Optional

# The project's Llama-style block (pre-norm RMSNorm, rotary positions, SwiGLU, no biases, no
# dropout) and the Llama papers' optimiser settings. Flags a user leaves out take Megatron-LM's
# defaults (a GPT-2/3 block: LayerNorm, learned positions, GeLU, biases, dropout 0.1), so every
# Llama-style preset says these explicitly.
LLAMA_BLOCK_SETTINGS = dict(normalization="RMSNorm", position_embedding_type="rope", swiglu=True, add_bias_linear=False,
                            hidden_dropout=0.0, attention_dropout=0.0)  # as ModelConfig keyword arguments
LLAMA_BLOCK = ["--normalization", "RMSNorm", "--position-embedding-type", "rope", "--swiglu", "--disable-bias-linear",
               "--hidden-dropout", "0", "--attention-dropout", "0"]  # the same as flags
LLAMA_OPTIMIZER = ["--adam-beta2", "0.95", "--weight-decay", "0.1", "--lr-decay-style", "cosine"]
_LLAMA = [*LLAMA_BLOCK, *LLAMA_OPTIMIZER, "--norm-epsilon", "1e-5", "--untie-embeddings-and-output-weights", "--micro-batch-size", "1"]

# A run that names no model (no --model and none of these flags) is the built-in tiny one.
SHAPE_FLAGS = ("num_layers", "hidden_size", "num_attention_heads")

MODELS: dict[str, list[str]] = {
    # The built-in default run (what `deepspeed scripts/pretrain.py` trains with no flags): a small
    # Llama-style model on the built-in corpus, logging every 10 steps. Its warm-up is a fraction of the
    # run (15 of the default 300 steps), so that any --train-iters a user types fits.
    "tiny": ["--num-layers", "4", "--hidden-size", "128", "--num-attention-heads", "4", "--ffn-hidden-size", "384",
             "--seq-length", "128", *LLAMA_BLOCK, *LLAMA_OPTIMIZER, "--min-lr", "3e-4", "--lr-warmup-fraction", "0.05",
             "--log-interval", "10", "--eval-iters", "10"],
    # The project's reference for speed: 940M-class Llama block, d2048 L16, seq 2048, vocab 32768.
    "reference": ["--num-layers", "16", "--hidden-size", "2048", "--num-attention-heads", "16", "--ffn-hidden-size", "5504",
                  "--seq-length", "2048", "--micro-batch-size", "4", "--vocab-size", "32768",
                  "--untie-embeddings-and-output-weights", *LLAMA_BLOCK, *LLAMA_OPTIMIZER],
    # Llama 2 (Touvron et al. 2023; the Hugging Face configs): 32k vocabulary, RoPE base 1e4, 4k context.
    "llama2-7b": ["--num-layers", "32", "--hidden-size", "4096", "--num-attention-heads", "32", "--ffn-hidden-size", "11008",
                  "--seq-length", "4096", "--vocab-size", "32000", *_LLAMA],
    "llama2-13b": ["--num-layers", "40", "--hidden-size", "5120", "--num-attention-heads", "40", "--ffn-hidden-size", "13824",
                   "--seq-length", "4096", "--vocab-size", "32000", *_LLAMA],
    # 70B uses grouped-query attention with 8 key/value heads.
    "llama2-70b": ["--num-layers", "80", "--hidden-size", "8192", "--num-attention-heads", "64", "--group-query-attention",
                   "--num-query-groups", "8", "--ffn-hidden-size", "28672", "--seq-length", "4096", "--vocab-size", "32000", *_LLAMA],
    # Llama 3 8B: 128k vocabulary, GQA with 8 groups, RoPE base 5e5, 8k context.
    "llama3-8b": ["--num-layers", "32", "--hidden-size", "4096", "--num-attention-heads", "32", "--group-query-attention",
                  "--num-query-groups", "8", "--ffn-hidden-size", "14336", "--seq-length", "8192", "--vocab-size", "128256",
                  "--rotary-base", "500000", *_LLAMA],
    # Llama 3 8B for long context: 128K tokens per sample, trained with context parallelism (its
    # layout: CP=8 on one node). Raise --rotary-base for contexts beyond what the base was trained at.
    "llama3-8b-128k": ["--num-layers", "32", "--hidden-size", "4096", "--num-attention-heads", "32", "--group-query-attention",
                       "--num-query-groups", "8", "--ffn-hidden-size", "14336", "--seq-length", "131072", "--vocab-size", "128256",
                       "--rotary-base", "500000", *_LLAMA],
    # Mixtral-style MoE (8 experts, top-2, SwiGLU experts, GQA) small enough for CPU tests.
    "mixtral-tiny": ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--group-query-attention",
                     "--num-query-groups", "2", "--ffn-hidden-size", "128", "--num-experts", "8", "--moe-router-topk", "2",
                     "--moe-aux-loss-coeff", "0.02", "--seq-length", "64", *LLAMA_BLOCK, *LLAMA_OPTIMIZER],
    # Mixtral-8x7B's shape (46.7B parameters, 12.9B active per token).
    "mixtral-8x7b": ["--num-layers", "32", "--hidden-size", "4096", "--num-attention-heads", "32", "--group-query-attention",
                     "--num-query-groups", "8", "--ffn-hidden-size", "14336", "--num-experts", "8", "--moe-router-topk", "2",
                     "--moe-aux-loss-coeff", "0.02", "--seq-length", "4096", "--vocab-size", "32000", "--rotary-base", "1000000",
                     "--untie-embeddings-and-output-weights", "--micro-batch-size", "1", *LLAMA_BLOCK, *LLAMA_OPTIMIZER],
}


@dataclass(frozen=True)
class SuggestedLayout:
    """Where a preset runs and how it is split. DP is what the world leaves over:
    nodes x gpus_per_node / (TP x PP x CP); EP is carved out of DP x CP."""

    nodes: int
    gpus_per_node: int
    tp: int = 1
    pp: int = 1
    ep: int = 1
    cp: int = 1
    zero: int = 1
    sequence_parallel: bool = False
    recompute: Optional[str] = None  # "full", "selective" or None
    micro_batch_size: int = 1
    global_batch_size: Optional[int] = None
    bf16: bool = True
    gpu_memory_gib: float = 80.0  # the GPU the layout was planned for (an H100 80GB node of 8)
    # Compiled layers: under PP the stage bodies otherwise run eager (on 2 x H200, the reference at PP=2 went from
    # 51,223 to 78,816 tok/s/GPU, benchmarks ref-pp2 and ref-pp2-compiled); off where --torch-compile is refused
    # (CP, EP) and on CPU ranks, where Inductor's C++ build of each kernel costs more than a short run gains.
    torch_compile: bool = True

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def dp(self) -> int:
        return self.world_size // (self.tp * self.pp * self.cp)

    def flags(self) -> list[str]:
        """The pretrain flags of this layout (no model shape, no paths)."""
        out = ["--tensor-model-parallel-size", str(self.tp), "--pipeline-model-parallel-size", str(self.pp),
               "--deepspeed_config", f"ds_configs/zero{self.zero}.json", "--micro-batch-size", str(self.micro_batch_size)]
        if self.ep > 1:
            out += ["--expert-model-parallel-size", str(self.ep)]
        if self.cp > 1:
            out += ["--context-parallel-size", str(self.cp)]
        if self.sequence_parallel:
            out.append("--sequence-parallel")
        if self.recompute:
            out += ["--recompute-granularity", self.recompute]
        if self.global_batch_size:
            out += ["--global-batch-size", str(self.global_batch_size)]
        if self.bf16:
            out.append("--bf16")
        if self.torch_compile:
            out.append("--torch-compile")
        return out


# The layouts are what `python scripts/plan.py --model NAME --gpus N` recommends
# for these node counts (8 x 80 GiB per node), or close to it with more memory to spare: planned
# with the PyTorch norm and SwiGLU, they fit whether or not the fused kernels build;
# tests/test_planner.py checks that each still fits. Global batches follow the papers' token
# counts: Llama 2 trained with 4M tokens per step (1024 x 4096).
LAYOUTS: dict[str, SuggestedLayout] = {
    # tiny-cpu.sbatch: 2 CPU ranks of one node, data parallel, fp32 (DeepSpeed's CPU accelerator).
    "tiny": SuggestedLayout(nodes=1, gpus_per_node=2, zero=1, micro_batch_size=8, bf16=False, gpu_memory_gib=1.0,
                            torch_compile=False),
    "reference": SuggestedLayout(nodes=1, gpus_per_node=8, zero=2, micro_batch_size=4, global_batch_size=256),
    "llama2-7b": SuggestedLayout(nodes=2, gpus_per_node=8, zero=2, global_batch_size=1024),
    "llama2-13b": SuggestedLayout(nodes=4, gpus_per_node=8, pp=8, zero=1, global_batch_size=1024),
    "llama2-70b": SuggestedLayout(nodes=8, gpus_per_node=8, tp=4, pp=16, zero=0, sequence_parallel=True, global_batch_size=1024),
    # the 128k-vocabulary logits at seq 8192 want TP: TP=1 layouts need 78-86 GiB
    "llama3-8b": SuggestedLayout(nodes=2, gpus_per_node=8, tp=2, zero=2, sequence_parallel=True, global_batch_size=512),
    # 128K tokens: each of 8 GPUs holds 16K of every sample (ring attention); full recompute
    # (planned 69.7 of 80 GiB, the 128k-vocabulary logits of 16K tokens taking 27.9); 4M tokens per step
    "llama3-8b-128k": SuggestedLayout(nodes=1, gpus_per_node=8, cp=8, zero=2, recompute="full", global_batch_size=32,
                                      torch_compile=False),
    # The MoE guides' layout (Megatron-core's Mixtral recipe): TP1 PP4 EP8, each node one EP group (the
    # all-to-all stays on NVLink), full recompute. Without recompute `scripts/plan.py` puts it at 71.5 of
    # 80 GiB for perfectly balanced routing, but expert activations grow with the busiest expert's load;
    # with it, 25.9 GiB (the guides measured about 28). SP is moot at TP1; FP8 (whose experts run as TE's
    # grouped FP8 GEMMs) cannot be combined with recompute yet.
    "mixtral-8x7b": SuggestedLayout(nodes=8, gpus_per_node=8, pp=4, ep=8, zero=1, recompute="full", global_batch_size=1024,
                                    torch_compile=False),
}


def model_flags(name: str) -> list[str]:
    """The flags of preset ``name``. Raises LookupError with one sentence listing the presets."""
    if name not in MODELS:
        raise LookupError(f"--model {name}: unknown preset; the presets are {', '.join(MODELS)}.")
    return list(MODELS[name])


def layout(name: str) -> SuggestedLayout:
    """Preset ``name``'s suggested layout. Raises LookupError with one sentence."""
    model_flags(name)  # the same sentence for an unknown name
    if name not in LAYOUTS:
        raise LookupError(f"--model {name} has no suggested layout; the presets with one are {', '.join(LAYOUTS)}.")
    return LAYOUTS[name]


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hybridlm.presets",
                                     description="Print a preset's flags or its suggested layout (the sbatch templates call this).")
    parser.add_argument("name", nargs="?", help="a preset name; without one, list the presets and their layouts")
    parser.add_argument("--layout-flags", action="store_true", help="print the layout's pretrain flags, shell-quoted")
    parser.add_argument("--resources", action="store_true", help="print 'NODES GPUS_PER_NODE' of the layout")
    args = parser.parse_args(argv)
    if args.name is None:
        for name in MODELS:
            lay = LAYOUTS.get(name)
            where = (f"{lay.nodes} x {lay.gpus_per_node} ({lay.gpu_memory_gib:g} GiB): TP={lay.tp} PP={lay.pp} DP={lay.dp} "
                     f"{f'CP={lay.cp} ' if lay.cp > 1 else ''}EP={lay.ep} ZeRO-{lay.zero}{' SP' if lay.sequence_parallel else ''}"
                     f"{' recompute ' + lay.recompute if lay.recompute else ''}"
                     f"{' compiled' if lay.torch_compile else ''}") if lay else "no suggested layout"
            print(f"{name:14s} {where}")
        return 0
    try:
        chosen = layout(args.name) if (args.layout_flags or args.resources) else None
        shape = model_flags(args.name)
    except LookupError as e:
        print(f"error: {e.args[0]}", file=sys.stderr)
        return 2
    if args.resources:
        print(chosen.nodes, chosen.gpus_per_node)
    elif args.layout_flags:
        print(shlex.join(chosen.flags()))
    else:
        print(shlex.join(shape))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
