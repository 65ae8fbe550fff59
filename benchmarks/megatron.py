"""Megatron-LM as a peer: ``pretrain_gpt.py`` on mock data, the same model and batch as the case.

The command is derived from the case's hybridlm configuration (``megatron_args``): the same
shape, vocabulary, sequence, micro- and global batch, precision and parallel layout, written
with Megatron's flags, plus what Megatron's own performance examples
(``examples/llama/train_llama3_8b_h100_fp8.sh``) run with:

  Transformer Engine layers and its fused attention (``--transformer-impl transformer_engine
  --attention-backend auto``), the distributed optimizer with overlapped gradient reduction and
  parameter gathering (``--use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather``,
  a no-op on one GPU), fused cross-entropy (``--cross-entropy-loss-fusion``, native: Megatron
  refuses TE's), ``--manual-gc`` (no Python GC during steps), and Megatron's default fusions
  (bias-SwiGLU, RoPE, masked softmax, gradient accumulation into TE's weight-gradient GEMMs).
  With FP8: ``--fp8-format/--fp8-recipe`` as the case, amax history 1024 with max, and
  ``--fp8-param-gather``; with the case's ``--cuda-graphs``: ``--cuda-graph-impl transformer_engine``
  (per-layer graphs through TE, as hybridlm captures them).

It runs under ``torchrun -m benchmarks.megatron SRC -- ARGS`` (this module's ``main``): Megatron's
source is put on the path, its dataset index helper is compiled beforehand by the runner (with
the C++ compiler directly: the GPU image need not have ``make``), and rank 0 prints its peak
memory and the device's bf16 peak at the end. Megatron logs each iteration's time
(``--log-interval 1``); ``parse_log`` takes the median over the iterations after the warm-up, like
hybridlm's runs.

What Megatron-LM (HEAD of 2026-11) needs at import beyond its source, on the GPU machine's image
(PyTorch 2.11, Triton, numpy, packaging, typing_extensions, einops, pybind11): Transformer Engine
(the ``te`` bundle), nothing else; apex is optional (without it Megatron takes TE's fused Adam and
norms and warns once).
"""
from __future__ import annotations

import os
import re
import runpy
import statistics
import subprocess
import sys
import sysconfig
import tarfile
from typing import Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TARBALL = os.path.join(ROOT, ".device", "megatron", "megatron-lm.tar.xz")  # benchmarks/stage.sh writes it
EXTRACTED = "/tmp/megatron-lm"
# hybridlm's attention backends as Megatron names them (cuDNN through TE is Megatron's "fused")
ATTENTION = {"auto": "auto", "cudnn": "fused", "te": "fused", "flash": "flash", "sdpa": "unfused"}
FP8_RECIPE = {"delayed": "delayed", "current": "tensorwise"}


def source_dir(path: Optional[str]) -> Optional[str]:
    """Megatron-LM's source: ``path`` (or $MEGATRON_LM) if given, else the staged tarball unpacked."""
    path = path or os.environ.get("MEGATRON_LM")
    if path:
        return path if os.path.exists(os.path.join(path, "pretrain_gpt.py")) else None
    if not os.path.exists(os.path.join(EXTRACTED, "pretrain_gpt.py")):
        if not os.path.exists(TARBALL):
            return None
        with tarfile.open(TARBALL) as tar:
            tar.extractall(EXTRACTED, filter="data")
    return EXTRACTED


def build_helpers(src: str) -> str:
    """Compile Megatron's dataset index helper (what its ``make`` would), once per source tree."""
    folder = os.path.join(src, "megatron", "core", "datasets")
    library = os.path.join(folder, "helpers_cpp" + sysconfig.get_config_var("EXT_SUFFIX"))
    if not os.path.exists(library):
        import pybind11
        subprocess.run([os.environ.get("CXX", "c++"), "-O3", "-shared", "-std=c++17", "-fPIC",
                        f"-I{pybind11.get_include()}", f"-I{sysconfig.get_paths()['include']}",
                        os.path.join(folder, "helpers.cpp"), "-o", library], check=True)
    return library


def _flags(pairs) -> list[str]:
    return [str(v) for pair in pairs for v in pair]


def megatron_args(run, *, iters: int) -> list[str]:
    """pretrain_gpt.py's flags for a validated hybridlm RunConfig (``run.validate(world)`` done)."""
    m, p, t = run.model, run.parallel, run.train
    args = _flags([
        ("--num-layers", m.num_layers), ("--hidden-size", m.hidden_size), ("--num-attention-heads", m.num_attention_heads),
        ("--ffn-hidden-size", m.ffn_hidden_size), ("--kv-channels", m.kv_channels), ("--seq-length", m.seq_length),
        ("--max-position-embeddings", max(m.max_position_embeddings or 0, m.seq_length)),
        ("--normalization", m.normalization), ("--norm-epsilon", m.norm_epsilon),
        ("--position-embedding-type", m.position_embedding_type), ("--rotary-base", int(m.rotary_base)),
        ("--hidden-dropout", m.hidden_dropout), ("--attention-dropout", m.attention_dropout),
        ("--init-method-std", m.init_method_std),
        ("--micro-batch-size", t.micro_batch_size), ("--global-batch-size", t.global_batch_size),
        ("--tensor-model-parallel-size", p.tensor_model_parallel_size),
        ("--pipeline-model-parallel-size", p.pipeline_model_parallel_size),
        ("--tokenizer-type", "NullTokenizer"), ("--vocab-size", m.vocab_size),
        ("--make-vocab-size-divisible-by", m.make_vocab_size_divisible_by),
        ("--lr", t.lr), ("--min-lr", t.min_lr), ("--lr-decay-style", t.lr_decay_style),
        ("--lr-warmup-iters", min(t.lr_warmup_iters, iters - 1)), ("--weight-decay", t.weight_decay),
        ("--adam-beta1", t.adam_beta1), ("--adam-beta2", t.adam_beta2), ("--clip-grad", t.clip_grad), ("--seed", t.seed),
        ("--train-iters", iters), ("--log-interval", 1), ("--eval-iters", 0),
        ("--eval-interval", iters),  # Megatron counts evaluation points even when none runs (it divides by this)
        ("--transformer-impl", "transformer_engine"), ("--attention-backend", ATTENTION[m.attention_backend]),
    ]) + ["--mock-data", "--log-throughput", "--use-distributed-optimizer", "--cross-entropy-loss-fusion", "--manual-gc",
          # Megatron's output layer (its own ColumnParallelLinear) needs apex's fused_weight_gradient_mlp_cuda for
          # gradient-accumulation fusion, and apex is not on the GPU machine; off, so the TE layers do not fuse either
          "--no-gradient-accumulation-fusion",
          # the causal mask is TE's own: a [seq, seq] mask built per sample in the dataloader goes unused (16 GiB of
          # bools a sample at 128K), so Megatron's long-context examples switch it off, as its best flags do here
          "--no-create-attention-mask-in-dataloader"]
    if m.num_query_groups != m.num_attention_heads:
        args += ["--group-query-attention", "--num-query-groups", str(m.num_query_groups)]
    args += ["--swiglu"] if m.swiglu else []
    args += [] if m.add_bias_linear else ["--disable-bias-linear"]
    args += ["--untie-embeddings-and-output-weights"] if m.untie_embeddings_and_output_weights else []
    args += ["--bf16"] if t.bf16 else (["--fp16"] if t.fp16 else [])
    args += ["--lr-warmup-fraction", str(t.lr_warmup_fraction)] if t.lr_warmup_fraction is not None else []  # the tiny preset's
    args += ["--sequence-parallel"] if p.sequence_parallel else []
    for flag, layers in (("--decoder-first-pipeline-num-layers", p.decoder_first_pipeline_num_layers),
                         ("--decoder-last-pipeline-num-layers", p.decoder_last_pipeline_num_layers)):
        args += [flag, str(layers)] if layers is not None else []  # the same split of the layers over the stages
    if p.context_parallel_size > 1:  # Megatron's own CP: Transformer Engine's attention with the same comm type
        args += _flags([("--context-parallel-size", p.context_parallel_size), ("--cp-comm-type", p.cp_comm_type)])
    if p.data_parallel_size > 1:
        args += ["--overlap-grad-reduce", "--overlap-param-gather"]
    if p.recompute_granularity == "full":
        args += ["--recompute-granularity", "full", "--recompute-method", "uniform",
                 "--recompute-num-layers", str(p.recompute_num_layers or 1)]
    elif p.recompute_granularity:
        args += ["--recompute-granularity", p.recompute_granularity]
    if m.num_experts:
        args += _flags([("--num-experts", m.num_experts), ("--moe-router-topk", m.moe_router_topk),
                        ("--moe-ffn-hidden-size", m.moe_ffn_hidden_size or m.ffn_hidden_size),
                        ("--moe-aux-loss-coeff", m.moe_aux_loss_coeff), ("--moe-layer-freq", m.moe_layer_freq),
                        ("--expert-model-parallel-size", p.expert_model_parallel_size),
                        ("--moe-router-load-balancing-type", "aux_loss"), ("--moe-token-dispatcher-type", "alltoall")])
        args += ["--moe-grouped-gemm"] if m.moe_grouped_gemm else []
        args += ["--moe-router-force-load-balancing"] if m.moe_router_force_load_balancing else []
        if m.moe_shared_expert_intermediate_size:
            args += ["--moe-shared-expert-intermediate-size", str(m.moe_shared_expert_intermediate_size)]
    if m.fp8_format:
        args += _flags([("--fp8-format", m.fp8_format), ("--fp8-recipe", FP8_RECIPE[m.fp8_recipe]),
                        ("--fp8-amax-history-len", m.fp8_amax_history_len), ("--fp8-amax-compute-algo", "max")])
        args += ["--fp8-param-gather"]
    if m.cuda_graphs:
        args += ["--cuda-graph-impl", "transformer_engine"]
    return args


_ITERATION = re.compile(r"iteration\s+(\d+)/\s*(\d+) \|.*?elapsed time per iteration \(ms\): ([\d.]+)")
_REPORTED = re.compile(r"throughput per GPU \(TFLOP/s/GPU\): ([\d.]+)")
_LOSS = re.compile(r"lm loss: ([\d.E+-]+)")
PEAK_LINE = "MEGATRON_PEAK_MEMORY_GIB"
DEVICE_LINE = "MEGATRON_DEVICE_PEAK_TFLOPS"


def parse_log(text: str, *, tokens_per_iteration: int, world: int, warmup: int) -> dict:
    """Per-iteration tokens/s/GPU after ``warmup`` iterations, Megatron's own TFLOP/s, loss and peak memory."""
    timed, reported, loss = [], [], None
    for line in text.splitlines():
        match = _ITERATION.search(line)
        if not match or int(match.group(1)) <= warmup:
            continue
        timed.append(tokens_per_iteration / (float(match.group(3)) / 1e3) / world)
        found = _REPORTED.search(line)
        if found:
            reported.append(float(found.group(1)))
        found = _LOSS.search(line)
        loss = float(found.group(1)) if found else loss
    if not timed:
        raise ValueError(f"no iteration after the first {warmup} was logged (see the log)")
    def last(prefix: str) -> Optional[float]:
        found = [line.split()[-1] for line in text.splitlines() if line.startswith(prefix)]
        return float(found[-1]) if found and found[-1] != "None" else None
    return {"tokens_per_sec_per_gpu": statistics.median(timed), "step_tokens_per_sec_per_gpu": timed,
            "peer_reported_tflops_per_gpu": statistics.median(reported) if reported else None,
            "final_loss": loss, "peak_memory_gib": last(PEAK_LINE), "peak_tflops": last(DEVICE_LINE)}


def main(argv: list[str]) -> None:
    """Under torchrun: ``python -m benchmarks.megatron SRC -- ARGS`` runs SRC/pretrain_gpt.py ARGS."""
    src, args = argv[0], [a for a in argv[1:] if a != "--"]
    sys.path.insert(0, src)
    import megatron.core.datasets.utils as dataset_utils
    dataset_utils.compile_helpers = lambda: build_helpers(src)  # built by the runner already; no `make`
    sys.argv = [os.path.join(src, "pretrain_gpt.py")] + args
    try:
        runpy.run_path(sys.argv[0], run_name="__main__")
    finally:
        import torch
        if torch.cuda.is_available() and os.environ.get("RANK", "0") == "0":
            from hybridlm.training.metrics import peak_tflops  # the device's dense bf16 peak, as hybridlm's runs take it
            print(f"{PEAK_LINE} {torch.cuda.max_memory_allocated() / 2**30:.3f}\n{DEVICE_LINE} {peak_tflops(None)}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
