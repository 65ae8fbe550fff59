"""LoRA checkpoints -> plain weights: W + (alpha / R) B A, for the Hugging Face export.

The reader hands each factor back whole (TP shards joined by their sharding tags, PP stages
found by name), so the merge is one matmul per adapted weight in fp32, cast afterwards. A fused
weight (QKV, SwiGLU's gate/up) has one adapter (``hybridlm.parallel.lora``): B's rows follow W's
blocks, so B A is already laid out as W, and the export's usual split into q/k/v (gate/up)
applies to the merged weight unchanged.
"""
from __future__ import annotations

import torch

from ..parallel.lora import is_adapter_name, lora_alpha


def adapter_names(weight_name: str) -> tuple[str, str]:
    """``X.weight`` -> (``X.lora.a``, ``X.lora.b``)."""
    prefix = weight_name[: -len("weight")]
    return prefix + "lora.a", prefix + "lora.b"


def lora_scale(cfg) -> float:
    return lora_alpha(cfg) / cfg.lora_rank


class MergedWeights:
    """A ``CheckpointReader``'s weights with the adapters folded in: ``names()`` lists the base's
    parameters only, ``weight(name)`` is W + scale B A where ``name`` has an adapter, else W."""

    def __init__(self, reader):
        self.reader = reader
        self.scale = lora_scale(reader.model_config)
        self._names = reader.names()

    def names(self) -> list[str]:
        return [n for n in self._names if not is_adapter_name(n)]

    def weight(self, name: str) -> torch.Tensor:
        base = self.reader.weight(name)
        a_name, b_name = adapter_names(name) if name.endswith(".weight") else ("", "")
        if a_name not in self._names:
            return base
        a, b = self.reader.weight(a_name).float(), self.reader.weight(b_name).float()
        return (base.float() + self.scale * (b @ a)).to(base.dtype)
