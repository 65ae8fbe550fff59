"""Throughput accounting: FLOPs per token, MFU, and the per-step log record.

FLOPs follow the standard (PaLM / nanoGPT) model-FLOPs count: 6 x (parameters in matmuls,
the output projection included, the input embedding lookup not) per token for forward
and backward, plus 12 x layers x seq x (heads x head_dim) per token for the attention
scores and their weighted sum. Recomputation is not counted (it is MFU, not hardware
FLOPs utilisation). The plain-PyTorch reference GPT of shared/device/README.md (d2048,
L16, GeLU 4h MLP, seq 2048, vocab 32768) comes to 6.04 GFLOP per token under this rule,
which reproduces its published 47.6% MFU at 77.9k tokens/s on a 989 TFLOP/s part; the
Llama-style reference preset (SwiGLU, ffn 5504) comes to 6.06. An MoE layer counts the
parameters a token is multiplied by (active parameters): its top-k experts, the router
and the shared expert, not the experts it skips.
"""
from __future__ import annotations

import json
import math
import os
import time

import torch

from ..config import ModelConfig

# Dense bf16 tensor-core peaks from the datasheets, TFLOP/s.
_PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "H800": 989.0, "GH200": 989.0, "A100": 312.0, "A800": 312.0,
                "L40S": 362.0, "A10G": 70.0, "B200": 2250.0}


def matmul_params(cfg: ModelConfig) -> int:
    """Parameters of the matmuls one token goes through (active ones in MoE layers)."""
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


def flops_per_token(cfg: ModelConfig) -> float:
    attention_scores = 12 * cfg.num_layers * cfg.seq_length * cfg.num_attention_heads * cfg.kv_channels
    return 6.0 * matmul_params(cfg) + attention_scores


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
               total_iters: int, skipped_steps: int = 0, moe: dict | None = None) -> dict:
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
