"""Named model shapes, as flag lists (so a preset is exactly what a user could type)."""
from __future__ import annotations

MODELS: dict[str, list[str]] = {
    # The built-in default run (what `deepspeed scripts/pretrain.py` trains with no flags).
    "tiny": [],
    # The project's reference for speed: 940M-class Llama block, d2048 L16, seq 2048, vocab 32768.
    "reference": ["--num-layers", "16", "--hidden-size", "2048", "--num-attention-heads", "16", "--ffn-hidden-size", "5504",
                  "--seq-length", "2048", "--micro-batch-size", "4", "--vocab-size", "32768",
                  "--untie-embeddings-and-output-weights"],
}


def model_flags(name: str) -> list[str]:
    if name not in MODELS:
        raise KeyError(f"--model {name}: unknown preset (have: {', '.join(sorted(MODELS))})")
    return list(MODELS[name])
