"""A LoRA or QLoRA checkpoint's adapters alone, as PEFT saves them: ``adapter_config.json`` and
``adapter_model.safetensors``, which ``peft.PeftModel.from_pretrained(base, output)`` loads onto the
Hugging Face model of the same base (for QLoRA: loaded with the same BitsAndBytesConfig).

Names are PEFT's for a causal LM: ``base_model.model.<module>.lora_A.weight`` [R, in] and
``...lora_B.weight`` [out, R] for each Hugging Face linear. hybridlm keeps one adapter per fused
weight (``hybridlm.parallel.lora``): QKV's B [q + k + v, R] under one A. Written as PEFT's q_proj,
k_proj and v_proj adapters, each gets that A and its rows of B, which computes exactly the same
(q = W_q x + s B_q A x, and so on); the same for SwiGLU's gate and up. PEFT keeps the three A's
apart once it trains them further.
"""
from __future__ import annotations

import json
import os
from typing import Callable, Optional

import torch

from ..config import ConfigError
from ..parallel.lora import is_adapter_name, lora_alpha
from .export import DTYPES, check_output
from .hf_names import GPT2, HF_CLASSES, export_architecture, parameter_rules
from .layout import resolve_tag_dir, staged_folder
from .reader import CheckpointReader

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PREFIX = "base_model.model."  # where PEFT's LoraModel keeps the causal LM


def peft_tensors(reader, dtype: Optional[torch.dtype] = None) -> tuple[dict[str, torch.Tensor], list[str]]:
    """{PEFT name: tensor} of a checkpoint's adapters, and the Hugging Face module names they target."""
    cfg = reader.model_config
    arch = export_architecture(cfg)
    if arch == GPT2:
        raise ConfigError("the PEFT adapter export covers the Llama, Mistral and Qwen2 families; GPT-2's Conv1D linears "
                          "store W transposed (PEFT's fan_in_fan_out), which it does not write: use --merge-lora.")
    adapted = sorted({name[: -len("lora.a")] + "weight" for name in reader.names() if name.endswith(".lora.a")})
    rules = parameter_rules(arch, cfg, adapted)
    tensors, targets = {}, set()
    for name in adapted:
        a = reader.weight(name[: -len("weight")] + "lora.a")
        b = reader.weight(name[: -len("weight")] + "lora.b")
        rule = rules[name]
        for hf_name, rows in zip(rule.theirs, rule.split(b)):
            module = hf_name[: -len(".weight")]
            targets.add(module.rsplit(".", 1)[-1])
            tensors[f"{PREFIX}{module}.lora_A.weight"] = a.to(dtype or a.dtype).clone()  # each part its own copy of A
            tensors[f"{PREFIX}{module}.lora_B.weight"] = rows.to(dtype or rows.dtype).contiguous()
    return tensors, sorted(targets)


def adapter_config(cfg, targets: list[str], base_model: Optional[str]) -> dict:
    """PEFT's LoraConfig for these adapters (fields left out take PEFT's defaults)."""
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": cfg.lora_rank, "lora_alpha": lora_alpha(cfg),
            "lora_dropout": cfg.lora_dropout, "target_modules": targets, "bias": "none", "fan_in_fan_out": False,
            "use_rslora": False, "use_dora": False, "init_lora_weights": True, "modules_to_save": None,
            "inference_mode": True, "base_model_name_or_path": base_model}


def bnb_config_line(cfg) -> str:
    """How to load the base for a QLoRA checkpoint's adapters in transformers, in Python."""
    dtype = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}[cfg.params_dtype]
    return (f"BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type={cfg.quant_type!r}, "
            f"bnb_4bit_use_double_quant={cfg.double_quant}, bnb_4bit_compute_dtype=torch.{dtype})")


def export_peft_adapter(checkpoint: str, output: str, *, dtype: Optional[str] = None, base_model: Optional[str] = None,
                        log: Callable[[str], None] = print) -> dict:
    """Write ``output`` (adapter_config.json, adapter_model.safetensors) from a LoRA/QLoRA ``checkpoint``.
    Only the adapters are read: a QLoRA checkpoint's base need not be present."""
    from safetensors.torch import save_file
    if dtype is not None and dtype not in DTYPES:
        raise ConfigError(f"--dtype {dtype}: choose one of {', '.join(DTYPES)}.")
    check_output(output)
    reader = CheckpointReader(resolve_tag_dir(checkpoint))
    cfg = reader.model_config
    if not cfg.lora_rank or not any(is_adapter_name(n) for n in reader.names()):
        raise ConfigError(f"--peft-adapter: --checkpoint {checkpoint} holds no LoRA adapters; export the model without it.")
    tensors, targets = peft_tensors(reader, DTYPES[dtype] if dtype else None)
    with staged_folder(output) as staging:
        save_file(tensors, os.path.join(staging, WEIGHTS_FILE), metadata={"format": "pt"})
        with open(os.path.join(staging, CONFIG_FILE), "w") as f:
            json.dump(adapter_config(cfg, targets, base_model), f, indent=2)
            f.write("\n")
        for name in os.listdir(staging):
            os.chmod(os.path.join(staging, name), 0o644)
    base = (f"the base loaded with quantization_config={bnb_config_line(cfg)}" if cfg.quant_bits
            else "the base model (the Hugging Face model the run's --load was imported from, or its convert_to_hf.py export)")
    log(f"exported the adapters of {reader.tag_dir} (rank {cfg.lora_rank}, alpha {lora_alpha(cfg):g}, on "
        f"{', '.join(targets)}: {len(tensors)} tensors) to {output} for PEFT; load them with PeftModel.from_pretrained onto "
        f"{HF_CLASSES[export_architecture(cfg)]} of {base}.")
    return {"files": [CONFIG_FILE, WEIGHTS_FILE], "target_modules": targets, "tensors": len(tensors)}
