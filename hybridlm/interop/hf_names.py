"""Our parameters and settings <-> Hugging Face's, one table per architecture.

Our names are layout-independent (``hybridlm.model.specs``): ``<i>.<module>.<param>`` where i is
the spec index (0 the embedding, 1..L the transformer layers, L+1 the final norm, L+2 an untied
head) and ``tied_modules.embed.`` the embedding shared with the head. A ``Rule`` maps one of our
tensors to one or more of theirs and back:

    attention.qkv      [q; k; v] rows           -> q_proj, k_proj, v_proj (GPT-2: c_attn, transposed)
    mlp.fc1            [gate; up] rows (SwiGLU)  -> gate_proj, up_proj
    mlp.moe.w1         [E, gate; up, hidden]    -> experts.<e>.w1 (gate), experts.<e>.w3 (up)   (Mixtral)
                                                -> experts.<e>.gate_proj, experts.<e>.up_proj   (Qwen2-MoE)
    mlp.moe.w2         [E, hidden, ffn]         -> experts.<e>.w2 / experts.<e>.down_proj
    mlp.shared.fc1/2, mlp.shared_gate           -> shared_expert.*, shared_expert_gate       (Qwen2-MoE)
    GPT-2 linears      Conv1D stores W^T

RoPE already uses Hugging Face's half-rotation layout, so q and k need no permutation. The
vocabulary is trimmed to the tokenizer's size on export and zero-padded for TP on import.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from ..config import ConfigError, ModelConfig

Tensor = torch.Tensor


@dataclass(frozen=True)
class Rule:
    theirs: tuple[str, ...]
    split: Callable[[Tensor], list[Tensor]]  # ours -> theirs, in the order of ``theirs``
    join: Callable[[list[Tensor], tuple], Tensor]  # theirs -> ours, given our full shape


def _same(name: str) -> Rule:
    return Rule((name,), lambda t: [t], lambda ts, shape: ts[0])


def _rows(names: tuple[str, ...], sizes: list[int]) -> Rule:
    return Rule(names, lambda t: list(torch.split(t, sizes, dim=0)), lambda ts, shape: torch.cat(ts, dim=0))


def _transposed(name: str) -> Rule:
    return Rule((name,), lambda t: [t.t()], lambda ts, shape: ts[0].t())


def _rows_transposed(name: str) -> Rule:
    return Rule((name,), lambda t: [t.t() if t.ndim == 2 else t], lambda ts, shape: ts[0].t() if ts[0].ndim == 2 else ts[0])


def _vocab(name: str, vocab_size: int) -> Rule:
    def join(ts, shape):
        if ts[0].shape[0] > shape[0]:
            raise ConfigError(f"{name} has {ts[0].shape[0]} rows, more than the model's padded vocabulary {shape[0]}.")
        out = ts[0].new_zeros(shape)
        out[: ts[0].shape[0]] = ts[0]
        return out
    return Rule((name,), lambda t: [t[:vocab_size]], join)


def _experts_w1(prefix: str, num_experts: int, ffn: int, gate_up: tuple[str, str] = ("w1", "w3")) -> Rule:
    names = tuple(f"{prefix}.experts.{e}.{w}.weight" for e in range(num_experts) for w in gate_up)
    return Rule(names, lambda t: [half for e in range(num_experts) for half in torch.split(t[e], [ffn, ffn], dim=0)],
                lambda ts, shape: torch.stack([torch.cat(ts[2 * e: 2 * e + 2], dim=0) for e in range(num_experts)]))


def _experts_w2(prefix: str, num_experts: int, down: str = "w2") -> Rule:
    names = tuple(f"{prefix}.experts.{e}.{down}.weight" for e in range(num_experts))
    return Rule(names, lambda t: list(t.unbind(0)), lambda ts, shape: torch.stack(ts))


# ---------------------------------------------------------------- architectures

LLAMA, MISTRAL, QWEN2, MIXTRAL, QWEN2_MOE, GPT2 = "llama", "mistral", "qwen2", "mixtral", "qwen2_moe", "gpt2"
HF_CLASSES = {LLAMA: "LlamaForCausalLM", MISTRAL: "MistralForCausalLM", QWEN2: "Qwen2ForCausalLM",
              MIXTRAL: "MixtralForCausalLM", QWEN2_MOE: "Qwen2MoeForCausalLM", GPT2: "GPT2LMHeadModel"}


def export_architecture(cfg: ModelConfig) -> str:
    """The Hugging Face family that computes exactly this model; ConfigError naming the setting otherwise."""
    if cfg.normalization == "LayerNorm" or cfg.position_embedding_type == "learned_absolute" or not cfg.swiglu:
        gpt2 = (cfg.normalization == "LayerNorm" and cfg.position_embedding_type == "learned_absolute" and not cfg.swiglu
                and cfg.add_bias_linear and cfg.num_experts is None)
        if not gpt2:
            raise ConfigError("the model has no Hugging Face equivalent: LayerNorm, learned positions and a GeLU MLP go "
                              "together as GPT-2 (with --add-bias-linear), RMSNorm + RoPE + SwiGLU as Llama; this one mixes them.")
        if cfg.num_query_groups != cfg.num_attention_heads or cfg.kv_channels * cfg.num_attention_heads != cfg.hidden_size:
            raise ConfigError("the GPT-2 style model uses grouped-query attention or a separate --kv-channels, which GPT-2 cannot express.")
        return GPT2
    if cfg.num_experts is not None:
        return _moe_architecture(cfg)
    if cfg.add_qkv_bias and not cfg.add_bias_linear:
        if cfg.kv_channels * cfg.num_attention_heads != cfg.hidden_size:
            raise ConfigError("the model has query/key/value biases (Qwen2) and a separate --kv-channels, which Qwen2 cannot express.")
        return QWEN2
    return LLAMA


def _moe_architecture(cfg: ModelConfig) -> str:
    """Mixtral (every layer MoE, softmax over the chosen k, no shared expert, no biases) or Qwen2-MoE
    (a gated shared expert, dense layers, pre-softmax top-k and query/key/value biases allowed)."""
    if (cfg.moe_router_score_function != "softmax" or cfg.moe_router_num_groups or cfg.moe_router_topk_scaling_factor
            or cfg.moe_router_enable_expert_bias):
        raise ConfigError("the MoE model routes with sigmoid-type scores, group-limited top-k, a scaling factor or an "
                          "expert bias, which neither Mixtral nor Qwen2-MoE computes (they take a softmax top-k).")
    if cfg.add_bias_linear:
        raise ConfigError("the MoE model has linear biases, which neither Mixtral nor Qwen2-MoE can express.")
    if not (cfg.moe_shared_expert_intermediate_size or cfg.moe_layer_freq != 1 or cfg.moe_router_pre_softmax or cfg.add_qkv_bias):
        return MIXTRAL
    if not cfg.moe_shared_expert_intermediate_size or not cfg.moe_shared_expert_gate:
        raise ConfigError("the MoE model has dense layers, pre-softmax routing or query/key/value biases, which only Qwen2-MoE "
                          "expresses, and Qwen2-MoE always has a gated shared expert: this model needs "
                          "--moe-shared-expert-intermediate-size and --moe-shared-expert-gate.")
    if cfg.kv_channels * cfg.num_attention_heads != cfg.hidden_size:
        raise ConfigError("the MoE model has a separate --kv-channels, which Qwen2-MoE cannot express.")
    return QWEN2_MOE


def parameter_rules(arch: str, cfg: ModelConfig, names: list[str]) -> dict[str, Rule]:
    """A Rule for each of our parameter ``names``; ConfigError for one the family has no place for."""
    rules = {}
    for name in names:
        rule = _gpt2_rule(name, cfg) if arch == GPT2 else _llama_rule(name, cfg, arch)
        if rule is None:
            raise ConfigError(f"parameter {name} has no place in a Hugging Face {HF_CLASSES[arch]}.")
        if cfg.apply_layernorm_1p and name.endswith("norm.weight"):
            rule = _gain_from_zero_centered(rule)
        rules[name] = rule
    return rules


def _gain_from_zero_centered(rule: Rule) -> Rule:
    """--apply-layernorm-1p keeps a norm's gain minus 1; Hugging Face keeps the gain."""
    return Rule(rule.theirs, lambda t: rule.split(t + 1), lambda ts, shape: rule.join(ts, shape) - 1)


def _split_layer(name: str, cfg: ModelConfig) -> tuple[Optional[int], str]:
    """('3.attention.qkv.weight') -> (2, 'attention.qkv.weight'); layer None for the embedding/norm/head."""
    match = re.match(r"^(\d+)\.(.*)$", name)
    if match and 1 <= int(match.group(1)) <= cfg.num_layers:
        return int(match.group(1)) - 1, match.group(2)
    return None, name


def _llama_rule(name: str, cfg: ModelConfig, arch: str) -> Optional[Rule]:
    layer, local = _split_layer(name, cfg)
    L = cfg.num_layers
    if layer is None:
        if local.endswith("word_embeddings.weight"):
            return _vocab("model.embed_tokens.weight", cfg.vocab_size)
        if local == f"{L + 1}.norm.weight":
            return _same("model.norm.weight")
        if local == f"{L + 2}.linear.weight":
            return _vocab("lm_head.weight", cfg.vocab_size)
        return None
    p = f"model.layers.{layer}"
    q, kv = cfg.num_attention_heads * cfg.kv_channels, cfg.num_query_groups * cfg.kv_channels
    ffn, shared = cfg.ffn_hidden_size, cfg.moe_shared_expert_intermediate_size
    table = {
        "input_norm.weight": lambda: _same(f"{p}.input_layernorm.weight"),
        "post_attention_norm.weight": lambda: _same(f"{p}.post_attention_layernorm.weight"),
        "attention.qkv.weight": lambda: _rows(tuple(f"{p}.self_attn.{x}_proj.weight" for x in "qkv"), [q, kv, kv]),
        "attention.qkv.bias": lambda: _rows(tuple(f"{p}.self_attn.{x}_proj.bias" for x in "qkv"), [q, kv, kv]),
        "attention.proj.weight": lambda: _same(f"{p}.self_attn.o_proj.weight"),
        "attention.proj.bias": lambda: _same(f"{p}.self_attn.o_proj.bias"),
        "mlp.fc1.weight": lambda: _rows((f"{p}.mlp.gate_proj.weight", f"{p}.mlp.up_proj.weight"), [ffn, ffn]),
        "mlp.fc1.bias": lambda: _rows((f"{p}.mlp.gate_proj.bias", f"{p}.mlp.up_proj.bias"), [ffn, ffn]),
        "mlp.fc2.weight": lambda: _same(f"{p}.mlp.down_proj.weight"),
        "mlp.fc2.bias": lambda: _same(f"{p}.mlp.down_proj.bias"),
    }
    if arch == MIXTRAL:
        table.update({
            "mlp.moe.router.weight": lambda: _same(f"{p}.block_sparse_moe.gate.weight"),
            "mlp.moe.w1": lambda: _experts_w1(f"{p}.block_sparse_moe", cfg.num_experts, cfg.moe_ffn_hidden_size),
            "mlp.moe.w2": lambda: _experts_w2(f"{p}.block_sparse_moe", cfg.num_experts),
        })
    if arch == QWEN2_MOE:
        table.update({
            "mlp.moe.router.weight": lambda: _same(f"{p}.mlp.gate.weight"),
            "mlp.moe.w1": lambda: _experts_w1(f"{p}.mlp", cfg.num_experts, cfg.moe_ffn_hidden_size, ("gate_proj", "up_proj")),
            "mlp.moe.w2": lambda: _experts_w2(f"{p}.mlp", cfg.num_experts, "down_proj"),
            "mlp.shared.fc1.weight": lambda: _rows((f"{p}.mlp.shared_expert.gate_proj.weight", f"{p}.mlp.shared_expert.up_proj.weight"),
                                                  [shared, shared]),
            "mlp.shared.fc2.weight": lambda: _same(f"{p}.mlp.shared_expert.down_proj.weight"),
            "mlp.shared_gate": lambda: _same(f"{p}.mlp.shared_expert_gate.weight"),
        })
    return table[local]() if local in table else None


def _gpt2_rule(name: str, cfg: ModelConfig) -> Optional[Rule]:
    layer, local = _split_layer(name, cfg)
    L = cfg.num_layers
    if layer is None:
        if local.endswith("word_embeddings.weight"):
            return _vocab("transformer.wte.weight", cfg.vocab_size)
        if local.endswith("position_embeddings"):
            return _same("transformer.wpe.weight")
        for suffix in ("weight", "bias"):
            if local == f"{L + 1}.norm.{suffix}":
                return _same(f"transformer.ln_f.{suffix}")
        if local == f"{L + 2}.linear.weight":
            return _vocab("lm_head.weight", cfg.vocab_size)
        return None
    p = f"transformer.h.{layer}"
    ours_to_theirs = {"input_norm": "ln_1", "post_attention_norm": "ln_2", "attention.qkv": "attn.c_attn",
                      "attention.proj": "attn.c_proj", "mlp.fc1": "mlp.c_fc", "mlp.fc2": "mlp.c_proj"}
    module, _, suffix = local.rpartition(".")
    if module not in ours_to_theirs:
        return None
    target = f"{p}.{ours_to_theirs[module]}.{suffix}"
    is_linear = not module.endswith("norm")
    return _rows_transposed(target) if is_linear else _same(target)


# ---------------------------------------------------------------- configs

def hf_config(arch: str, cfg: ModelConfig, *, bos: Optional[int], eos: Optional[int], dtype: str):
    """A transformers config object for ``cfg`` (the class of the installed transformers)."""
    import transformers
    tied = not cfg.untie_embeddings_and_output_weights
    common = dict(vocab_size=cfg.vocab_size, bos_token_id=bos, eos_token_id=eos, tie_word_embeddings=tied, dtype=dtype)
    if arch == GPT2:
        return transformers.GPT2Config(n_positions=cfg.max_position_embeddings, n_embd=cfg.hidden_size, n_layer=cfg.num_layers,
                                       n_head=cfg.num_attention_heads, n_inner=cfg.ffn_hidden_size, activation_function="gelu_new",
                                       layer_norm_epsilon=cfg.norm_epsilon, resid_pdrop=cfg.hidden_dropout,
                                       embd_pdrop=cfg.hidden_dropout, attn_pdrop=cfg.attention_dropout,
                                       architectures=[HF_CLASSES[arch]], **common)
    llama_like = dict(hidden_size=cfg.hidden_size, intermediate_size=cfg.ffn_hidden_size, num_hidden_layers=cfg.num_layers,
                      num_attention_heads=cfg.num_attention_heads, num_key_value_heads=cfg.num_query_groups,
                      head_dim=cfg.kv_channels, hidden_act="silu", max_position_embeddings=cfg.max_position_embeddings,
                      rms_norm_eps=cfg.norm_epsilon, attention_dropout=cfg.attention_dropout,
                      rope_theta=cfg.rotary_base,  # transformers 5 turns it into rope_parameters; 4 reads it as is
                      architectures=[HF_CLASSES[arch]], **common)
    if arch == MIXTRAL:
        return transformers.MixtralConfig(**{**llama_like, "intermediate_size": cfg.moe_ffn_hidden_size},
                                          num_local_experts=cfg.num_experts, num_experts_per_tok=cfg.moe_router_topk,
                                          router_aux_loss_coef=cfg.moe_aux_loss_coeff, sliding_window=None)
    if arch == QWEN2_MOE:
        dense = [layer for layer in range(cfg.num_layers) if not cfg.is_moe_layer(layer)]
        return transformers.Qwen2MoeConfig(**llama_like, moe_intermediate_size=cfg.moe_ffn_hidden_size,
                                           shared_expert_intermediate_size=cfg.moe_shared_expert_intermediate_size,
                                           num_experts=cfg.num_experts, num_experts_per_tok=cfg.moe_router_topk,
                                           norm_topk_prob=not cfg.moe_router_pre_softmax, decoder_sparse_step=1,
                                           mlp_only_layers=dense, qkv_bias=cfg.add_qkv_bias,
                                           router_aux_loss_coef=cfg.moe_aux_loss_coeff, use_sliding_window=False)
    if arch == QWEN2:
        llama_like.pop("head_dim")
        return transformers.Qwen2Config(**llama_like, use_sliding_window=False)
    return transformers.LlamaConfig(**llama_like, attention_bias=cfg.add_bias_linear, mlp_bias=cfg.add_bias_linear)
