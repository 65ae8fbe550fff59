"""Named model shapes, as flag lists (so a preset is exactly what a user could type)."""
from __future__ import annotations

MODELS: dict[str, list[str]] = {
    # The built-in default run (what `deepspeed scripts/pretrain.py` trains with no flags).
    "tiny": [],
    # The project's reference for speed: 940M-class Llama block, d2048 L16, seq 2048, vocab 32768.
    "reference": ["--num-layers", "16", "--hidden-size", "2048", "--num-attention-heads", "16", "--ffn-hidden-size", "5504",
                  "--seq-length", "2048", "--micro-batch-size", "4", "--vocab-size", "32768",
                  "--untie-embeddings-and-output-weights"],
    # Mixtral-style MoE (8 experts, top-2, SwiGLU experts, GQA) small enough for CPU tests.
    "mixtral-tiny": ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--num-query-groups", "2",
                     "--ffn-hidden-size", "128", "--num-experts", "8", "--moe-router-topk", "2", "--moe-aux-loss-coeff", "0.02",
                     "--seq-length", "64"],
    # Mixtral-8x7B's shape (46.7B parameters, 12.9B active per token); with --bf16 on a Slurm
    # allocation, e.g. EP=8 x TP=2 x PP=4 on 64 GPUs.
    "mixtral-8x7b": ["--num-layers", "32", "--hidden-size", "4096", "--num-attention-heads", "32", "--num-query-groups", "8",
                     "--ffn-hidden-size", "14336", "--num-experts", "8", "--moe-router-topk", "2", "--moe-aux-loss-coeff", "0.02",
                     "--seq-length", "4096", "--vocab-size", "32000", "--rotary-base", "1000000",
                     "--untie-embeddings-and-output-weights", "--micro-batch-size", "1"],
}


def model_flags(name: str) -> list[str]:
    if name not in MODELS:
        raise KeyError(f"--model {name}: unknown preset (have: {', '.join(sorted(MODELS))})")
    return list(MODELS[name])
