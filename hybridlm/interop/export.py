"""A hybridlm checkpoint of any layout -> a Hugging Face model directory.

    config.json, generation_config.json       the transformers config of the matching family
    model.safetensors                          or model-0000i-of-0000n.safetensors + model.safetensors.index.json
    tokenizer files                            the run's tokenizer (see ``tokenizer_files``)

Parameters are read one at a time (``CheckpointReader``: files memory-mapped, TP/EP shards
joined by the parameters' sharding tags), mapped by ``hf_names`` and written into shards of at
most ``max_shard_bytes``, so memory holds about one shard. Everything is written into a
temporary directory beside ``output`` and renamed into place at the end: an interrupted
export never leaves a directory that looks complete.
"""
from __future__ import annotations

import json
import os
import shutil
import sys
from typing import Callable, Optional

import torch

from ..config import ConfigError
from ..parallel.quantized import DTYPES
from .hf_names import HF_CLASSES, export_architecture, hf_config, parameter_rules
from .layout import resolve_tag_dir, staged_folder
from .lora import MergedWeights, lora_scale, open_checkpoint
from .tokenizer_files import write_tokenizer

_TORCH_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
SAFE_WEIGHTS = "model.safetensors"
SAFE_INDEX = "model.safetensors.index.json"


def parse_size(text: str) -> int:
    """'5GB', '500MB', '2048' -> bytes (powers of 1000, as Hugging Face counts)."""
    units = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "B": 1}
    upper = text.strip().upper()
    for unit, scale in units.items():
        if upper.endswith(unit) and upper[: -len(unit)].strip().replace(".", "", 1).isdigit():
            return int(float(upper[: -len(unit)]) * scale)
    if upper.isdigit():
        return int(upper)
    raise ConfigError(f"--max-shard-size {text}: not a size (e.g. 5GB, 500MB, or bytes).")


class ShardWriter:
    """Tensors in, safetensors shards of at most ``max_bytes`` out (a tensor larger than that gets
    a shard of its own), named as ``save_pretrained`` names them once the count is known."""

    def __init__(self, directory: str, max_bytes: int):
        self.directory, self.max_bytes = directory, max_bytes
        self.pending: dict[str, torch.Tensor] = {}
        self.pending_bytes = 0
        self.shards: list[tuple[str, list[str]]] = []  # (temporary file, tensor names)
        self.total_bytes = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        size = tensor.numel() * tensor.element_size()
        if self.pending and self.pending_bytes + size > self.max_bytes:
            self._flush()
        self.pending[name] = tensor.contiguous()
        self.pending_bytes += size
        self.total_bytes += size

    def _flush(self) -> None:
        from safetensors.torch import save_file
        path = os.path.join(self.directory, f"shard-{len(self.shards):05d}.tmp")
        save_file(self.pending, path, metadata={"format": "pt"})
        os.chmod(path, 0o644)  # safetensors creates files private to the user; save_pretrained's are readable
        self.shards.append((path, list(self.pending)))
        self.pending, self.pending_bytes = {}, 0

    def close(self) -> list[str]:
        if self.pending or not self.shards:
            self._flush()
        if len(self.shards) == 1:
            os.replace(self.shards[0][0], os.path.join(self.directory, SAFE_WEIGHTS))
            return [SAFE_WEIGHTS]
        count, weight_map, names = len(self.shards), {}, []
        for i, (path, tensors) in enumerate(self.shards, start=1):
            final = f"model-{i:05d}-of-{count:05d}.safetensors"
            os.replace(path, os.path.join(self.directory, final))
            weight_map.update({t: final for t in tensors})
            names.append(final)
        with open(os.path.join(self.directory, SAFE_INDEX), "w") as f:
            json.dump({"metadata": {"total_size": self.total_bytes}, "weight_map": dict(sorted(weight_map.items()))}, f, indent=2)
        return names + [SAFE_INDEX]


def check_output(output: str) -> None:
    if os.path.exists(output) and (not os.path.isdir(output) or os.listdir(output)):
        raise ConfigError(f"--output {output} already exists and is not an empty directory; choose a new one.")


def export_to_hf(checkpoint: str, output: str, *, dtype: Optional[str] = None, max_shard_size: str = "5GB",
                 progress: bool = True, log: Callable[[str], None] = print, merge_lora: bool = False) -> dict:
    """Write the Hugging Face directory ``output`` from ``checkpoint`` (a run directory or a
    global_step folder). Returns a summary (architecture, files, dtype). A LoRA checkpoint needs
    ``merge_lora``: its adapters are folded into the weights (``hybridlm.interop.lora``)."""
    max_bytes = parse_size(max_shard_size)
    if dtype is not None and dtype not in DTYPES:
        raise ConfigError(f"--dtype {dtype}: choose one of {', '.join(DTYPES)}.")
    check_output(output)
    reader = open_checkpoint(resolve_tag_dir(checkpoint))  # a QLoRA checkpoint joined with the base it names
    cfg, layout = reader.model_config, reader.layout
    if cfg.lora_rank and not merge_lora:
        raise ConfigError(f"--checkpoint {checkpoint} holds LoRA adapters (rank {cfg.lora_rank}); add --merge-lora to write "
                          "the merged weights W + (alpha/R) B A as a plain model, or --peft-adapter to write the adapters "
                          "alone for PEFT.")
    if merge_lora and not cfg.lora_rank:
        raise ConfigError(f"--merge-lora: --checkpoint {checkpoint} holds no LoRA adapters; drop --merge-lora.")
    weights = MergedWeights(reader) if merge_lora else reader
    arch = export_architecture(cfg)
    rules = parameter_rules(arch, cfg, weights.names())
    if dtype is None:
        dtype = "bf16" if layout.bf16 else "fp16" if layout.fp16 else "fp32"
    torch_dtype = DTYPES[dtype]
    tied = not cfg.untie_embeddings_and_output_weights
    if cfg.num_experts is not None and cfg.moe_capacity_factor:
        log(f"note: trained with --moe-capacity-factor {cfg.moe_capacity_factor}; Mixtral is dropless, so its outputs "
            "differ wherever training would have dropped tokens")

    with staged_folder(output) as staging:
        writer = ShardWriter(staging, max_bytes)
        for name in _progress(weights.names(), progress, f"export {os.path.basename(reader.tag_dir)}"):
            rule = rules[name]
            for hf_name, tensor in zip(rule.theirs, rule.split(weights.weight(name))):
                writer.add(hf_name, tensor.to(torch_dtype))
        files = writer.close()
        if reader.info.tokenizer_known:
            eod, tokenizer_line = write_tokenizer(reader.info.settings, staging, cfg.seq_length)
        else:
            eod, tokenizer_line = None, "tokenizer: not written, the checkpoint was imported without tokenizer files"
        end_of_turn, chat_line = chat_template_files(reader.tag_dir, staging)
        hf = hf_config(arch, cfg, bos=eod, eos=eod, dtype=_TORCH_DTYPE_NAMES[torch_dtype])
        hf.save_pretrained(staging)
        _add_legacy_rope_theta(os.path.join(staging, "config.json"))
        _write_generation_config(staging, eod, end_of_turn)
    merged = f", LoRA adapters merged (scale {lora_scale(cfg):g})" if merge_lora else ""
    if merge_lora and cfg.quant_bits:
        merged += f" onto the 4-bit base dequantized ({cfg.quant_type}, quantized from {reader.base.tag_dir})"
    log(f"exported {reader.tag_dir} ({layout.describe()}, {len(rules)} parameters{merged}) to {output} as "
        f"{HF_CLASSES[arch]} in {dtype}{', tied embeddings' if tied else ''}: {', '.join(files)}")
    log(tokenizer_line)
    if chat_line:
        log(chat_line)
    return {"architecture": HF_CLASSES[arch], "files": files, "dtype": dtype, "eos_token_id": eod, "end_of_turn_id": end_of_turn}


def _add_legacy_rope_theta(path: str) -> None:
    """transformers < 5 reads the RoPE base from "rope_theta" (else its default, 1e6 for Mixtral):
    keep it beside v5's "rope_parameters" so the export computes the same on both."""
    with open(path) as f:
        config = json.load(f)
    theta = (config.get("rope_parameters") or {}).get("rope_theta")
    if theta is not None and "rope_theta" not in config:
        config["rope_theta"] = theta
        with open(path, "w") as f:
            json.dump(config, f, indent=2, sort_keys=True)
            f.write("\n")


def chat_template_files(tag_dir: str, output: str) -> tuple[Optional[int], Optional[str]]:
    """The chat template for the export (the one a fine-tuning run rendered its data with, saved in
    the checkpoint, over the tokenizer's own), and the id of the token that ends a reply under it
    (None without a template): generation must stop there, not only at the end-of-document token."""
    from ..data.chat_template import TEMPLATE_FILE, end_of_turn_id, load_template
    saved = os.path.join(tag_dir, TEMPLATE_FILE)
    if os.path.isfile(saved):
        shutil.copy2(saved, os.path.join(output, TEMPLATE_FILE))
    if not os.path.isfile(os.path.join(output, "tokenizer.json")):
        return None, None
    try:
        template = load_template(output)
    except ConfigError:
        return None, None
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(os.path.join(output, "tokenizer.json"))
    end = end_of_turn_id(template, tok)
    origin = "the fine-tuning run's" if os.path.isfile(saved) else "the tokenizer's"
    return end, (f"chat template: {origin}" + (f"; replies end with {tok.id_to_token(end)} (id {end}), added to "
                                               "generation_config.eos_token_id" if end is not None else ""))


def _write_generation_config(directory: str, eod: Optional[int], end_of_turn: Optional[int] = None) -> None:
    from transformers import GenerationConfig
    eos = [t for t in dict.fromkeys((eod, end_of_turn)) if t is not None]
    GenerationConfig(bos_token_id=eod, eos_token_id=eos[0] if len(eos) == 1 else eos or None, pad_token_id=eod).save_pretrained(directory)


def _progress(items, enabled: bool, description: str):
    if not enabled:
        return items
    from tqdm import tqdm
    return tqdm(items, desc=description, unit="tensor", file=sys.stderr)
