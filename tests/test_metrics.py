"""FLOPs and MFU by Megatron-LM's rule, checked against a transcription of its formula."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from hybridlm.config import parse_args
from hybridlm.presets import LLAMA_BLOCK
from hybridlm.training.metrics import StepLog, flops_per_token, num_floating_point_operations


def megatron_transformer_flops(args, batch_size):
    """megatron/training/training.py num_floating_point_operations -> transformer_flops, for BSHD
    batches without MLA, MTP, linear attention, latent MoE or an attention output gate, transcribed."""
    seqlen_squared_sum_in_batch = batch_size * args.seq_length * args.seq_length
    total_real_tokens_in_batch = batch_size * args.seq_length
    if not args.group_query_attention:
        args.num_query_groups = args.num_attention_heads
    if args.num_experts is None:
        num_dense_layers, num_moe_layers, num_experts_routed_to = args.num_layers, 0, 0
    else:
        moe_layer_pattern = [1 if (i % args.moe_layer_freq == 0) else 0 for i in range(args.num_layers)]
        num_moe_layers = sum(moe_layer_pattern)
        num_dense_layers = args.num_layers - num_moe_layers
        num_experts_routed_to = args.moe_router_topk
    num_layers = args.num_layers
    moe_ffn_hidden_size = args.moe_ffn_hidden_size if args.moe_ffn_hidden_size is not None else args.ffn_hidden_size
    shared_expert_ffn_hidden_size = (0 if args.moe_shared_expert_intermediate_size is None
                                     else args.moe_shared_expert_intermediate_size)
    forward_backward_expansion_factor = 3
    fma_expansion_factor = 2
    ffn_expansion_factor = 3 if args.swiglu else 2
    query_projection_size = args.kv_channels * args.num_attention_heads
    key_projection_size = args.kv_channels * args.num_query_groups
    value_projection_size = args.kv_channels * args.num_query_groups
    standard_self_attn_term = (forward_backward_expansion_factor * fma_expansion_factor
                               * (args.hidden_size * (query_projection_size + key_projection_size + value_projection_size)
                                  + query_projection_size * args.hidden_size))
    standard_self_attn_core_term = forward_backward_expansion_factor * fma_expansion_factor * query_projection_size / 2 * 2
    self_attn_term = standard_self_attn_term * num_layers
    self_attn_core_term = standard_self_attn_core_term * num_layers
    return (total_real_tokens_in_batch
            * (forward_backward_expansion_factor * fma_expansion_factor * args.hidden_size
               * ((args.ffn_hidden_size * ffn_expansion_factor) * num_dense_layers
                  + (moe_ffn_hidden_size * num_experts_routed_to * ffn_expansion_factor) * num_moe_layers
                  + (shared_expert_ffn_hidden_size * ffn_expansion_factor) * num_moe_layers)
               + self_attn_term
               + forward_backward_expansion_factor * fma_expansion_factor * args.hidden_size * args.padded_vocab_size)
            + seqlen_squared_sum_in_batch * self_attn_core_term)


def _megatron_args(flags: list[str]) -> tuple:
    """Our config for ``flags`` and the Megatron argument namespace the same command line gives."""
    cfg = parse_args(flags).validate(world_size=1)
    m = cfg.model
    args = SimpleNamespace(seq_length=m.seq_length, num_layers=m.num_layers, hidden_size=m.hidden_size,
                           num_attention_heads=m.num_attention_heads, kv_channels=m.kv_channels,
                           group_query_attention=m.group_query_attention,
                           num_query_groups=m.num_query_groups if m.group_query_attention else None,
                           ffn_hidden_size=m.ffn_hidden_size, swiglu=m.swiglu, num_experts=m.num_experts,
                           moe_layer_freq=m.moe_layer_freq, moe_router_topk=m.moe_router_topk,
                           moe_ffn_hidden_size=m.moe_ffn_hidden_size if m.num_experts else None,
                           moe_shared_expert_intermediate_size=m.moe_shared_expert_intermediate_size,
                           padded_vocab_size=m.padded_vocab_size)
    return m, args


SHAPES = {
    "dense GPT (GeLU, MHA)": ["--num-layers", "24", "--hidden-size", "2048", "--num-attention-heads", "16", "--seq-length", "2048",
                              "--vocab-size", "50257"],
    "Llama GQA SwiGLU": ["--num-layers", "32", "--hidden-size", "4096", "--num-attention-heads", "32", "--group-query-attention",
                         "--num-query-groups", "8", "--ffn-hidden-size", "14336", "--kv-channels", "128", "--seq-length", "8192",
                         "--vocab-size", "128256", *LLAMA_BLOCK],
    "--num-query-groups without GQA": ["--num-layers", "4", "--hidden-size", "512", "--num-attention-heads", "8",
                                       "--num-query-groups", "2", "--seq-length", "1024", "--vocab-size", "32000", *LLAMA_BLOCK],
    "MoE top-2 every 2nd layer, shared expert": ["--num-layers", "6", "--hidden-size", "1024", "--num-attention-heads", "16",
                                                 "--group-query-attention", "--num-query-groups", "4", "--num-experts", "8",
                                                 "--moe-router-topk", "2", "--moe-layer-freq", "2", "--moe-ffn-hidden-size", "1408",
                                                 "--moe-shared-expert-intermediate-size", "2816", "--ffn-hidden-size", "2816",
                                                 "--seq-length", "4096", "--vocab-size", "32000", *LLAMA_BLOCK],
    "Mixtral 8x7B": ["--model", "mixtral-8x7b"],
    "long sequence (128K)": ["--model", "reference", "--seq-length", "131072"],
}


@pytest.mark.parametrize("name", SHAPES)
@pytest.mark.parametrize("batch", [1, 512])
def test_flops_equal_megatrons_formula(name, batch):
    model, args = _megatron_args(SHAPES[name])
    assert num_floating_point_operations(model, batch) == pytest.approx(megatron_transformer_flops(args, batch), rel=1e-12)
    assert flops_per_token(model) == pytest.approx(megatron_transformer_flops(args, 1) / model.seq_length, rel=1e-12)


def test_causal_attention_is_counted_half():
    model, _ = _megatron_args(SHAPES["long sequence (128K)"])
    unmasked_attention = 12 * model.num_layers * model.seq_length * model.num_attention_heads * model.kv_channels
    halved = flops_per_token(model)
    # the old rule: projections and MLP as now plus unmasked attention; at 128K attention dominates
    assert (halved + unmasked_attention / 2) / halved == pytest.approx(1.83, abs=0.01)


def test_the_step_log_reports_tflops_and_mfu_from_the_same_rule():
    model, _ = _megatron_args(SHAPES["Llama GQA SwiGLU"])
    log = StepLog(model, world_size=8, tokens_per_step=128 * model.seq_length, peak=989.0, metrics_file=None, enabled=False)
    record = log.record(iteration=1, loss=1.0, lr=1e-4, grad_norm=None, step_seconds=10.0, total_iters=1)
    want = num_floating_point_operations(model, 128) / 10.0 / 8 / 1e12
    assert record["tflops_per_gpu"] == pytest.approx(want, rel=1e-12)
    assert record["mfu"] == pytest.approx(want / 989.0, rel=1e-12)
