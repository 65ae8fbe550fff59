"""A local Hugging Face Llama / Mistral / Qwen2 / Mixtral / Qwen2-MoE (or GPT-2) directory -> a hybridlm checkpoint.

The config.json becomes our model flags (refusing what our model cannot compute: RoPE scaling,
a sliding window shorter than the sequence, other activations), the safetensors tensors become
our full parameters by ``hf_names``' rules, and ``writer`` lays them out at the chosen TP/PP/EP.
Weights are read from safetensors only, lazily, one tensor at a time; every tensor's shape is
checked against what config.json implies before it is used. The output directory holds the
checkpoint, a ``config.yaml`` with the model's flags (``pretrain.py --config``), and the
tokenizer files under ``tokenizer/``.
"""
from __future__ import annotations

import glob
import json
import os
import re
import shutil
import sys
from typing import Callable, Optional

import torch

from ..config import ConfigError, config_from_dict
from .hf_names import GPT2, HF_CLASSES, LLAMA, MISTRAL, MIXTRAL, QWEN2, QWEN2_MOE, parameter_rules
from .layout import parameter_table
from .tokenizer_files import HF_TOKENIZER_FILES
from .writer import write_checkpoint

SUPPORTED = {"LlamaForCausalLM": LLAMA, "MistralForCausalLM": MISTRAL, "Qwen2ForCausalLM": QWEN2,
             "MixtralForCausalLM": MIXTRAL, "Qwen2MoeForCausalLM": QWEN2_MOE, "GPT2LMHeadModel": GPT2}
# Non-parameter tensors some checkpoints carry (causal-mask and RoPE buffers of older transformers).
_IGNORED = re.compile(r"(\.attn\.(masked_)?bias|rotary_emb\.inv_freq)$")


class SafetensorsDir:
    """The tensors of a Hugging Face directory, opened lazily from its safetensors file(s)."""

    def __init__(self, directory: str):
        from safetensors import safe_open
        self.directory = directory
        index_path = os.path.join(directory, "model.safetensors.index.json")
        if os.path.isfile(index_path):
            try:
                with open(index_path) as f:
                    weight_map = json.load(f)["weight_map"]
            except (ValueError, KeyError) as e:
                raise ConfigError(f"--hf {directory}: model.safetensors.index.json is malformed ({e}).") from None
            shards = sorted(set(weight_map.values()))
            for shard in shards:
                if not os.path.isfile(os.path.join(directory, shard)):
                    raise ConfigError(f"--hf {directory}: shard {shard} named in model.safetensors.index.json is missing.")
            for path in glob.glob(os.path.join(directory, "*.safetensors")):
                if os.path.basename(path) not in shards:
                    raise ConfigError(f"--hf {directory}: extra shard {os.path.basename(path)} is not in "
                                      "model.safetensors.index.json; the directory mixes two checkpoints.")
        elif os.path.isfile(os.path.join(directory, "model.safetensors")):
            shards, weight_map = ["model.safetensors"], None
        elif glob.glob(os.path.join(directory, "*.bin")) or glob.glob(os.path.join(directory, "*.pt")):
            raise ConfigError(f"--hf {directory}: holds only pickled weights (*.bin / *.pt); weights are read from "
                              "safetensors only (convert them with transformers' save_pretrained(safe_serialization=True)).")
        else:
            raise ConfigError(f"--hf {directory}: no model.safetensors or model.safetensors.index.json.")
        self.handles = {}
        for shard in shards:
            try:
                self.handles[shard] = safe_open(os.path.join(directory, shard), framework="pt")
            except Exception as e:  # noqa: BLE001 - a pickle or a truncated file named .safetensors
                raise ConfigError(f"--hf {directory}: {shard} is not a safetensors file ({str(e).splitlines()[0][:120]}).") from None
        self.where = {}
        for shard, handle in self.handles.items():
            for key in handle.keys():
                if weight_map is not None and weight_map.get(key) != shard:
                    raise ConfigError(f"--hf {directory}: tensor {key} is in {shard} but the index says {weight_map.get(key)}.")
                self.where[key] = shard
        if weight_map is not None:
            absent = sorted(set(weight_map) - set(self.where))
            if absent:
                raise ConfigError(f"--hf {directory}: tensor {absent[0]} named in the index is in none of the shards.")

    def get(self, name: str) -> torch.Tensor:
        if name not in self.where:
            raise ConfigError(f"--hf {self.directory}: no tensor {name}, which config.json implies.")
        return self.handles[self.where[name]].get_tensor(name)

    def shape(self, name: str) -> tuple:
        if name not in self.where:
            raise ConfigError(f"--hf {self.directory}: no tensor {name}, which config.json implies.")
        return tuple(self.handles[self.where[name]].get_slice(name).get_shape())


def read_hf_config(directory: str) -> tuple[str, object]:
    path = os.path.join(directory, "config.json")
    if not os.path.isdir(directory):
        raise ConfigError(f"--hf {directory}: no such directory.")
    if not os.path.isfile(path):
        raise ConfigError(f"--hf {directory}: no config.json.")
    try:
        with open(path) as f:
            raw = json.load(f)
    except ValueError as e:
        raise ConfigError(f"--hf {directory}: config.json is not valid JSON ({e}).") from None
    names = raw.get("architectures") or []
    arch = next((SUPPORTED[n] for n in names if n in SUPPORTED), None)
    if arch is None:
        raise ConfigError(f"--hf {directory}: architecture {', '.join(names) or raw.get('model_type', 'unknown')} is not "
                          f"supported (have: {', '.join(SUPPORTED)}).")
    from transformers import AutoConfig
    return arch, AutoConfig.from_pretrained(directory, local_files_only=True)


def _rope(hf) -> tuple[float, str]:
    params = getattr(hf, "rope_parameters", None) or {}
    scaling = getattr(hf, "rope_scaling", None) or {}
    kind = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    theta = params.get("rope_theta", getattr(hf, "rope_theta", 10000.0))
    return float(theta), kind


def model_flags(arch: str, hf, directory: str, seq_length: Optional[int]) -> dict:
    """config.json -> our model settings; ConfigError naming what our model cannot compute."""
    where = f"--hf {directory}: config.json"
    if arch == GPT2:
        if hf.activation_function not in ("gelu_new", "gelu_pytorch_tanh"):
            raise ConfigError(f"{where} has activation_function {hf.activation_function}; only the tanh GeLU of GPT-2 is supported.")
        if getattr(hf, "scale_attn_by_inverse_layer_idx", False) or getattr(hf, "reorder_and_upcast_attn", False) \
                or not getattr(hf, "scale_attn_weights", True):
            raise ConfigError(f"{where} changes GPT-2's attention scaling, which hybridlm does not compute.")
        positions = hf.n_positions
        return dict(num_layers=hf.n_layer, hidden_size=hf.n_embd, num_attention_heads=hf.n_head, num_query_groups=hf.n_head,
                    ffn_hidden_size=hf.n_inner or 4 * hf.n_embd, max_position_embeddings=positions,
                    seq_length=seq_length or positions, vocab_size=hf.vocab_size, normalization="LayerNorm",
                    norm_epsilon=hf.layer_norm_epsilon, position_embedding_type="learned_absolute", swiglu=False,
                    add_bias_linear=True, untie_embeddings_and_output_weights=not hf.tie_word_embeddings,
                    make_vocab_size_divisible_by=1, group_query_attention=False, hidden_dropout=0.0, attention_dropout=0.0)
    if hf.hidden_act != "silu":
        raise ConfigError(f"{where} has hidden_act {hf.hidden_act}; only SiLU (SwiGLU) is supported.")
    theta, kind = _rope(hf)
    if kind != "default":
        raise ConfigError(f"{where} uses RoPE scaling '{kind}'; hybridlm computes plain RoPE only.")
    positions = hf.max_position_embeddings
    seq = seq_length or min(positions, 4096)
    window = getattr(hf, "sliding_window", None)
    if arch in (QWEN2, QWEN2_MOE) and not getattr(hf, "use_sliding_window", False):
        window = None
    if window is not None and window < seq:
        raise ConfigError(f"{where} has sliding_window {window}, shorter than --seq-length {seq}; hybridlm has no "
                          f"sliding-window attention, so pass --seq-length {window} or less.")
    heads = hf.num_attention_heads
    groups = getattr(hf, "num_key_value_heads", None) or heads
    # every architecture value explicit: what is left out takes Megatron-LM's defaults (GPT-2/3 block)
    flags = dict(num_layers=hf.num_hidden_layers, hidden_size=hf.hidden_size, ffn_hidden_size=hf.intermediate_size,
                 num_attention_heads=heads, group_query_attention=groups != heads, num_query_groups=groups,
                 kv_channels=getattr(hf, "head_dim", None) or hf.hidden_size // heads, max_position_embeddings=positions,
                 seq_length=seq, vocab_size=hf.vocab_size, normalization="RMSNorm", norm_epsilon=hf.rms_norm_eps,
                 position_embedding_type="rope", rotary_base=theta, swiglu=True,
                 untie_embeddings_and_output_weights=not hf.tie_word_embeddings, make_vocab_size_divisible_by=1,
                 add_bias_linear=False, hidden_dropout=0.0, attention_dropout=getattr(hf, "attention_dropout", 0.0) or 0.0)
    if arch == LLAMA:
        attention_bias, mlp_bias = bool(getattr(hf, "attention_bias", False)), bool(getattr(hf, "mlp_bias", False))
        if attention_bias != mlp_bias:
            raise ConfigError(f"{where} has attention_bias={attention_bias} but mlp_bias={mlp_bias}; hybridlm's "
                              "--add-bias-linear puts biases on both or neither.")
        flags["add_bias_linear"] = attention_bias
    if arch == QWEN2:
        flags["add_qkv_bias"] = True
    if arch == MIXTRAL:
        flags.update(num_experts=hf.num_local_experts, moe_router_topk=hf.num_experts_per_tok,
                     moe_ffn_hidden_size=hf.intermediate_size, moe_aux_loss_coeff=hf.router_aux_loss_coef)
    if arch == QWEN2_MOE:
        flags.update(_qwen2_moe_flags(hf, where))
    return flags


def _qwen2_moe_flags(hf, where: str) -> dict:
    """Qwen2-MoE: a softmax top-k (renormalised over the k with norm_topk_prob, else pre-softmax), a
    shared expert behind a sigmoid gate, dense layers where mlp_only_layers or decoder_sparse_step say."""
    layers = hf.num_hidden_layers
    sparse = [i for i in range(layers) if i not in (hf.mlp_only_layers or []) and (i + 1) % hf.decoder_sparse_step == 0]
    freq = next((f for f in range(1, layers + 1) if sparse == list(range(0, layers, f))), None)
    if freq is None or not hf.num_experts:
        raise ConfigError(f"{where} puts experts in layers {sparse}; hybridlm's --moe-layer-freq puts them in every k-th "
                          "layer from layer 0.")
    if not hf.shared_expert_intermediate_size:
        raise ConfigError(f"{where} has no shared expert (shared_expert_intermediate_size 0), which Qwen2-MoE's layer always runs.")
    return dict(num_experts=hf.num_experts, moe_router_topk=hf.num_experts_per_tok, moe_ffn_hidden_size=hf.moe_intermediate_size,
                moe_layer_freq=freq, moe_shared_expert_intermediate_size=hf.shared_expert_intermediate_size,
                moe_shared_expert_gate=True, moe_router_pre_softmax=not hf.norm_topk_prob,
                moe_aux_loss_coeff=hf.router_aux_loss_coef, add_qkv_bias=bool(getattr(hf, "qkv_bias", True)))


def import_from_hf(hf_dir: str, output: str, *, tp: int = 1, pp: int = 1, ep: int = 1, seq_length: Optional[int] = None,
                   dtype: Optional[str] = None, progress: bool = True, log: Callable[[str], None] = print) -> dict:
    """Write a weights-only hybridlm checkpoint of ``hf_dir`` at TP/PP/EP into the new directory ``output``."""
    from .export import DTYPES, check_output
    check_output(output)
    if dtype is not None and dtype not in DTYPES:
        raise ConfigError(f"--dtype {dtype}: choose one of {', '.join(DTYPES)}.")
    arch, hf = read_hf_config(hf_dir)
    tensors = SafetensorsDir(hf_dir)
    flags = model_flags(arch, hf, hf_dir, seq_length)
    tokenizer_dir = os.path.join(os.path.abspath(output), "tokenizer")
    tokenizer_files = [f for f in HF_TOKENIZER_FILES if os.path.isfile(os.path.join(hf_dir, f))]
    if tokenizer_files:
        flags.update(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=tokenizer_dir)
    first = tensors.get(next(iter(tensors.where)))
    stored = dtype or {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(first.dtype, "fp32")
    flags.update(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, expert_model_parallel_size=ep,
                 micro_batch_size=1, bf16=stored == "bf16")
    run = config_from_dict(flags)
    run.validate(world_size=tp * pp * ep)  # divisibility of heads, groups, widths, experts by the layout
    run.model.padded_vocab_size = run.model.pad_vocab(tp)
    table = parameter_table(run.model, tp, ep)
    rules = parameter_rules(arch, run.model, list(table))
    _check_tensors(tensors, rules, table, hf, hf_dir)
    cast = DTYPES[dtype] if dtype else None

    def full_tensor(name: str) -> torch.Tensor:
        rule = rules[name]
        joined = rule.join([tensors.get(t) for t in rule.theirs], table[name].full_shape)
        return joined.to(cast) if cast is not None else joined

    bar = _progress(progress, f"import {os.path.basename(os.path.normpath(hf_dir))}")
    files = write_checkpoint(output, run, full_tensor, bar, tokenizer_known=bool(tokenizer_files))
    if tokenizer_files:
        os.makedirs(tokenizer_dir, exist_ok=True)
        for name in tokenizer_files:
            shutil.copy2(os.path.join(hf_dir, name), os.path.join(tokenizer_dir, name))
    padded = run.model.padded_vocab_size
    log(f"imported {hf_dir} ({HF_CLASSES[arch]}, {len(table)} parameters, {stored}) to {output} at TP={tp} PP={pp} EP={ep}: "
        f"{len(files)} files" + (f"; vocabulary {hf.vocab_size} zero-padded to {padded} rows for TP={tp}" if padded != hf.vocab_size else ""))
    log("tokenizer: " + (f"copied {', '.join(tokenizer_files)} to {tokenizer_dir}" if tokenizer_files
                         else f"none in {hf_dir}; pass --tokenizer-type/--tokenizer-model when training"))
    log(f"continue with: deepspeed scripts/pretrain.py --config {os.path.join(output, 'config.yaml')} --load {output} "
        f"--save {output} --data-path ... [--finetune]")
    return {"architecture": HF_CLASSES[arch], "files": files, "dtype": stored}


def _check_tensors(tensors: SafetensorsDir, rules: dict, table: dict, hf, directory: str) -> None:
    """Every tensor config.json implies is there with the implied shape, and nothing else is."""
    used = set()
    for name, rule in rules.items():
        expected = [tuple(t.shape) for t in rule.split(torch.empty(table[name].full_shape, device="meta"))]
        for hf_name, shape in zip(rule.theirs, expected):
            found = tensors.shape(hf_name)
            if found != shape:
                raise ConfigError(f"--hf {directory}: tensor {hf_name} has shape {found}, but config.json implies {shape}.")
            used.add(hf_name)
    for key in tensors.where:
        tied_head = key == "lm_head.weight" and getattr(hf, "tie_word_embeddings", False)
        if key not in used and not tied_head and not _IGNORED.search(key):
            raise ConfigError(f"--hf {directory}: tensor {key} has no place in the model config.json describes.")


def _progress(enabled: bool, description: str):
    if not enabled:
        return lambda items: items
    from tqdm import tqdm
    return lambda items: tqdm(items, desc=description, unit="file", file=sys.stderr)
