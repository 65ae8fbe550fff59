"""Throughput accounting: FLOPs by Megatron-LM's rule, MFU, and the per-step log record.

FLOPs are Megatron-LM's ``num_floating_point_operations`` (megatron/training/training.py,
``transformer_flops``, for unpacked sequences), so TFLOP/s and MFU here compare with what
Megatron-LM prints for the same model. Per token, forward and backward (3 GEMMs of 2 FLOPs
per multiply-add: the factor 12 below is 3 x 2 x 2 for a GEMM pair, 6 for one):

    6 x h x (q + 2 kv + q)              per layer: QKV and output projections (q = heads x head_dim,
                                         kv = query groups x head_dim: GQA counts its smaller K and V)
    6 x s x q                            per layer: QK^T and softmax(QK^T)V, causal so half of s x s
    6 x h x ffn x (3 if SwiGLU else 2)   per dense layer
    6 x h x (topk x moe_ffn + shared) x (3 if SwiGLU else 2)   per MoE layer: the experts a token visits
    6 x h x padded vocabulary            the output layer

The router and the input embedding lookup are not counted, nor is recomputation (it is MFU, not
hardware FLOPs utilisation). Counting attention as if unmasked (12 x s x q per layer, the rule
used here before) overstates a causal model's FLOPs: by about 7% at seq 2048 for the reference
model, and far more at long context.
"""
from __future__ import annotations

import json
import math
import os
import time

import torch

from ..config import ModelConfig
from .monitor import monitor_line

# Dense bf16 tensor-core peaks from the datasheets, TFLOP/s.
_PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "H800": 989.0, "GH200": 989.0, "A100": 312.0, "A800": 312.0,
                "L40S": 362.0, "A10G": 70.0, "B200": 2250.0}


def matmul_params(cfg: ModelConfig) -> int:
    """Parameters of the matmuls one token goes through (active ones in MoE layers, the router included)."""
    h, d = cfg.hidden_size, cfg.kv_channels
    attention = h * d * (cfg.num_attention_heads + 2 * cfg.num_query_groups) + cfg.num_attention_heads * d * h
    per_width = h * (3 if cfg.swiglu else 2)
    total = h * cfg.padded_vocab_size
    for layer in range(cfg.num_layers):
        if cfg.is_moe_layer(layer):
            mlp = per_width * (cfg.moe_router_topk * cfg.moe_ffn_hidden_size + (cfg.moe_shared_expert_intermediate_size or 0))
            mlp += h * cfg.num_experts
        else:
            mlp = per_width * cfg.ffn_hidden_size
        total += attention + mlp
    return total


def num_floating_point_operations(cfg: ModelConfig, batch_size: int, seq_length: int | None = None) -> float:
    """FLOPs of one global batch of ``batch_size`` samples of ``seq_length`` tokens (default: the
    model's), forward and backward: Megatron-LM's ``num_floating_point_operations(args, batch_size)``
    for a transformer without MLA, MTP or linear attention. Needs ``cfg.padded_vocab_size``."""
    s = seq_length or cfg.seq_length
    fwd_bwd_fma = 3 * 2  # three GEMMs (forward, weight and data gradients) of 2 FLOPs per multiply-add
    ffn_factor = 3 if cfg.swiglu else 2  # SwiGLU's fc1 is two GEMMs
    moe_layers = sum(cfg.is_moe_layer(i) for i in range(cfg.num_layers))
    dense_layers = cfg.num_layers - moe_layers
    routed = cfg.moe_router_topk if cfg.num_experts is not None else 0
    moe_ffn = cfg.moe_ffn_hidden_size or cfg.ffn_hidden_size
    shared = cfg.moe_shared_expert_intermediate_size or 0
    h = cfg.hidden_size
    query = cfg.kv_channels * cfg.num_attention_heads
    key = value = cfg.kv_channels * cfg.num_query_groups
    projections = fwd_bwd_fma * (h * (query + key + value) + query * h) * cfg.num_layers
    core_attention = fwd_bwd_fma * query / 2 * 2 * cfg.num_layers  # causal mask: half of QK^T and of (QK^T)V
    mlp = fwd_bwd_fma * h * (cfg.ffn_hidden_size * ffn_factor * dense_layers
                              + moe_ffn * routed * ffn_factor * moe_layers + shared * ffn_factor * moe_layers)
    logits = fwd_bwd_fma * h * cfg.padded_vocab_size
    tokens = batch_size * s
    return tokens * (mlp + projections + logits) + batch_size * s * s * core_attention


def flops_per_token(cfg: ModelConfig) -> float:
    """Forward + backward FLOPs per trained token at the model's sequence length (Megatron's rule)."""
    return num_floating_point_operations(cfg, 1) / cfg.seq_length


def attention_core_flops_per_token(cfg: ModelConfig) -> float:
    """The part of ``flops_per_token`` in QK^T and softmax(QK^T)V (what selective recompute repeats)."""
    return 6 * cfg.seq_length * cfg.kv_channels * cfg.num_attention_heads * cfg.num_layers


def peak_tflops(override: float | None) -> float | None:
    """The device's bf16 peak, or None on a CPU (MFU is then not reported unless given)."""
    if override:
        return override
    if torch.cuda.is_available():
        name = torch.cuda.get_device_name()
        for key, value in _PEAK_TFLOPS.items():
            if key in name:
                return value
    return None


class StepLog:
    """One console line and one JSON line per logged step (rank 0 writes)."""

    def __init__(self, cfg: ModelConfig, *, world_size: int, tokens_per_step: int, peak: float | None,
                 metrics_file: str | None, enabled: bool):
        self.flops_per_step = flops_per_token(cfg) * tokens_per_step
        self.tokens_per_step, self.world_size, self.peak, self.enabled = tokens_per_step, world_size, peak, enabled
        self.file = None
        if enabled and metrics_file:
            os.makedirs(os.path.dirname(os.path.abspath(metrics_file)), exist_ok=True)
            self.file = open(metrics_file, "a")

    def record(self, *, iteration: int, loss: float, lr: float, grad_norm: float | None, step_seconds: float,
               total_iters: int, skipped_steps: int = 0, moe: dict | None = None, monitor: dict | None = None,
               extra: dict | None = None) -> dict:
        """``monitor``: the training monitor's figures (``Monitor.report``); ``extra``: the task's values
        (fine-tuning: loss tokens and their rate, DPO's rewards), logged as given."""
        tokens_per_sec = self.tokens_per_step / step_seconds
        tflops = self.flops_per_step / step_seconds / self.world_size / 1e12
        record = {
            "iteration": iteration, "loss": loss, "lr": lr, "grad_norm": grad_norm,
            "tokens_per_sec": tokens_per_sec, "tokens_per_sec_per_gpu": tokens_per_sec / self.world_size,
            "tflops_per_gpu": tflops, "mfu": tflops / self.peak if self.peak else None,
            "step_seconds": step_seconds, "skipped_steps": skipped_steps, "time": time.time(),
        }
        if torch.cuda.is_available():
            record["max_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
        if moe is not None:  # see moe_metrics.collect_moe_stats
            record.update(moe_aux_loss=moe["aux_loss"], moe_z_loss=moe["z_loss"], moe_dropped_fraction=moe["dropped_fraction"],
                          moe_layers=moe["layers"])
        record.update(monitor or {})
        record.update(extra or {})
        if self.enabled:
            mfu = f" | mfu {100 * record['mfu']:.1f}%" if record["mfu"] is not None else ""
            mem = f" | mem {record['max_memory_gib']:.1f} GiB" if "max_memory_gib" in record else ""
            norm = f"{grad_norm:.3f}" if grad_norm is not None else "n/a"
            skipped = f" | skipped {skipped_steps}" if skipped_steps else ""
            eta = (total_iters - iteration) * step_seconds
            print(f"iter {iteration:>6}/{total_iters} | loss {loss:.4f} | lr {lr:.3e} | grad norm {norm} | "
                  f"{record['tokens_per_sec_per_gpu']:,.0f} tok/s/gpu | {tflops:.1f} TFLOP/s/gpu{mfu}{mem}{skipped} | "
                  f"eta {eta / 60:.1f} min", flush=True)
            if moe is not None:
                print(_moe_line(moe), flush=True)
            if monitor:
                print(monitor_line(monitor), flush=True)
            if extra:
                print("    " + " | ".join(f"{k} {_number(v)}" for k, v in extra.items()), flush=True)
            self._write(record)
        return record

    def record_eval(self, *, iteration: int, loss: float) -> dict:
        record = {"iteration": iteration, "valid_loss": loss, "valid_ppl": math.exp(min(loss, 700.0)), "time": time.time()}
        if self.enabled:
            print(f"iter {iteration:>6} | validation loss {loss:.4f} | perplexity {record['valid_ppl']:.3f}", flush=True)
            self._write(record)
        return record

    def _write(self, record: dict) -> None:
        if self.file:
            self.file.write(json.dumps(record) + "\n")
            self.file.flush()

    def close(self) -> None:
        if self.file:
            self.file.close()


def _number(value) -> str:
    return f"{value:,}" if isinstance(value, int) else f"{value:,.0f}" if abs(value) >= 1000 else f"{value:.4f}"


def _load(tokens_per_expert: list[float]) -> str:
    """Tokens per expert (per step), or with more than 16 experts the busiest and idlest over the mean."""
    if len(tokens_per_expert) <= 16:
        return f"[{' '.join(f'{c:.0f}' for c in tokens_per_expert)}]"
    mean = max(sum(tokens_per_expert) / len(tokens_per_expert), 1e-30)
    return f"load max {max(tokens_per_expert) / mean:.2f}x min {min(tokens_per_expert) / mean:.2f}x"


def _moe_line(moe: dict) -> str:
    """aux/z loss and dropped fraction, then per layer: tokens per expert (per step), dropped, aux."""
    layers = " | ".join(f"L{n} {_load(stats['tokens_per_expert'])} drop {100 * stats['dropped_fraction']:.1f}% "
                        f"aux {stats['aux_loss']:.4f}" for n, stats in moe["layers"].items())
    return (f"    moe | aux loss {moe['aux_loss']:.4f} | z loss {moe['z_loss']:.4f} | dropped {100 * moe['dropped_fraction']:.2f}% "
            f"| tokens/expert: {layers}")
