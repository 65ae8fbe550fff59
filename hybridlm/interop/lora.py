"""LoRA checkpoints -> plain weights: W + (alpha / R) B A, for the Hugging Face export; and QLoRA
checkpoints read as whole models.

The reader hands each factor back whole (TP shards joined by their sharding tags, PP stages
found by name), so the merge is one matmul per adapted weight in fp32, cast afterwards. A fused
weight (QKV, SwiGLU's gate/up) has one adapter (``hybridlm.parallel.lora``): B's rows follow W's
blocks, so B A is already laid out as W, and the export's usual split into q/k/v (gate/up)
applies to the merged weight unchanged.

A QLoRA checkpoint (``--quant-bits``) stores the adapters and names the checkpoint its 4-bit base
was quantized from (with a fingerprint of that folder's files), not the base itself:
``open_checkpoint`` reads the adapters from it and every other weight from the base, and the merge
puts the adapters on the base as training saw it, each weight quantized and dequantized again
(bitsandbytes is deterministic, so these are the bits the run computed with).
"""
from __future__ import annotations

import os
import torch

from ..config import ConfigError, ModelConfig
from ..parallel.lora import is_adapter_name, lora_alpha
from .layout import CheckpointInfo, fingerprint, read_info
from .reader import CheckpointReader


def adapter_names(weight_name: str) -> tuple[str, str]:
    """``X.weight`` -> (``X.lora.a``, ``X.lora.b``)."""
    prefix = weight_name[: -len("weight")]
    return prefix + "lora.a", prefix + "lora.b"


def lora_scale(cfg) -> float:
    return lora_alpha(cfg) / cfg.lora_rank


class MergedWeights:
    """A ``CheckpointReader``'s weights with the adapters folded in: ``names()`` lists the base's
    parameters only, ``weight(name)`` is W + scale B A where ``name`` has an adapter, else W. Under a
    4-bit base (QLoRA), W is each block linear's weight as the run computed with it: dequantized."""

    def __init__(self, reader):
        self.reader = reader
        self.scale = lora_scale(reader.model_config)
        self._names = reader.names()
        cfg = reader.model_config
        self.spec = None
        if cfg.quant_bits:
            from ..parallel.quantized import QuantSpec
            self.spec = QuantSpec.of(cfg)

    def names(self) -> list[str]:
        return [n for n in self._names if not is_adapter_name(n)]

    def weight(self, name: str) -> torch.Tensor:
        base = self.base_weight(name)
        a_name, b_name = adapter_names(name) if name.endswith(".weight") else ("", "")
        if a_name not in self._names:
            return base
        a, b = self.reader.weight(a_name).float(), self.reader.weight(b_name).float()
        return (base.float() + self.scale * (b @ a)).to(base.dtype)

    def base_weight(self, name: str) -> torch.Tensor:
        base = self.reader.weight(name)
        if self.spec is None:
            return base
        from ..parallel.quantized import is_quantized_name, part_rows, roundtrip
        if not is_quantized_name(name):
            return base
        device = "cuda" if torch.cuda.is_available() else "cpu"
        rows = part_rows(self.reader.params[name].tp_sharding, base.shape)
        return roundtrip(base.to(device), rows, self.spec).cpu()


# ---------------------------------------------------------------- QLoRA checkpoints

def _quantization(settings: dict) -> tuple:
    return settings.get("quant_bits"), settings.get("quant_type", "nf4"), settings.get("double_quant", True)


def _describe_quantization(bits, kind, double) -> str:
    return f"--quant-bits {bits} --quant-type {kind} --{'' if double else 'no-'}double-quant"


def quantized_base_of(tag_dir: str, cfg: ModelConfig, flag: str = "--load") -> str:
    """The checkpoint folder a QLoRA run quantizes its base from when it loads ``tag_dir``: a checkpoint
    without adapters is the base itself; a QLoRA checkpoint names its base. ConfigError (one sentence)
    for adapters trained on a dense base or another quantization, and for a base that is gone or changed."""
    info = read_info(tag_dir, flag)
    if not info.settings.get("lora_rank"):
        return os.path.abspath(tag_dir)
    saved, here = _quantization(info.settings), (cfg.quant_bits, cfg.quant_type, cfg.double_quant)
    if saved[0] is None:
        raise ConfigError(f"{flag} {tag_dir} holds LoRA adapters trained on a dense base; continue it without --quant-bits, "
                          "or export it with convert_to_hf.py --merge-lora and start QLoRA from that.")
    if saved != here:
        raise ConfigError(f"{flag} {tag_dir} holds adapters trained on a base quantized with {_describe_quantization(*saved)}; "
                          f"continue with the same settings (this run has {_describe_quantization(*here)}).")
    return check_base(info, flag)


def check_base(info: CheckpointInfo, flag: str) -> str:
    """The base folder a QLoRA checkpoint names, if it is still the one its adapters were trained on."""
    base = info.quantized_base or {}
    path = base.get("checkpoint")
    if not path:
        raise ConfigError(f"{flag} {info.tag_dir}: a QLoRA checkpoint without the name of its base "
                          "(hybridlm_checkpoint.json has no quantized_base); it cannot be read.")
    if not os.path.isdir(path):
        raise ConfigError(f"{flag} {info.tag_dir}: its adapters were trained on the 4-bit base quantized from {path}, which "
                          "no longer exists; a QLoRA checkpoint stores only the adapters, so restore that folder.")
    if fingerprint(path) != base.get("fingerprint"):
        raise ConfigError(f"{flag} {info.tag_dir}: its adapters were trained on the 4-bit base quantized from {path}, whose "
                          "files have changed since (another checkpoint written there?); restore the original base.")
    return path


class QLoRACheckpoint:
    """A QLoRA checkpoint read as a whole model, with ``CheckpointReader``'s interface: its own files
    for the adapters (and its optimizer state, buffers and client state), the base checkpoint it names
    for every other weight, dense as the base holds them."""

    def __init__(self, reader: CheckpointReader, base: CheckpointReader):
        self.run, self.base = reader, base

    def __getattr__(self, name):
        return getattr(self.run, name)

    def weight(self, name: str) -> torch.Tensor:
        return self.run.weight(name) if is_adapter_name(name) else self.base.weight(name)

    def weights(self):
        for name in self.run.params:
            yield name, self.weight(name)


def open_checkpoint(tag_dir: str, flag: str = "--checkpoint") -> CheckpointReader | QLoRACheckpoint:
    """A reader of any checkpoint folder as a whole model (a QLoRA checkpoint joined with its base)."""
    reader = CheckpointReader(tag_dir, flag)
    if not reader.info.quantized_base:
        return reader
    return QLoRACheckpoint(reader, CheckpointReader(check_base(reader.info, flag), flag))


def refuse_dense_resume(info: CheckpointInfo, cfg: ModelConfig, flag: str = "--load") -> None:
    """A QLoRA checkpoint continues only as QLoRA: its base is not in it, and its adapters fit the 4-bit base."""
    if info.quantized_base and not cfg.quant_bits:
        raise ConfigError(f"{flag} {info.tag_dir} holds QLoRA adapters trained on a 4-bit base "
                          f"({_describe_quantization(*_quantization(info.settings))}); continue with those flags, or "
                          "export it with convert_to_hf.py --merge-lora and continue from the merged model.")
