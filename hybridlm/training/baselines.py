"""What a user would run instead, timed the same way on the same shape: the peers of
``scripts/benchmark.py --system/--baselines`` (and of the benchmark suite's cases).

  torch          this project's model definition as a plain single-GPU PyTorch module: fp32
                 weights, bf16 autocast, fused AdamW, no DeepSpeed (the fastest simple loop)
  torch-compile  the same with ``torch.compile`` of the whole model
  hf-zero2       Hugging Face ``LlamaForCausalLM`` of the same shape under DeepSpeed ZeRO-2,
                 bf16, SDPA attention (what most fine-tuning stacks do)

Each runs ``warmup`` untimed steps, then ``steps`` timed steps of ``accumulation`` micro-batches
of random tokens. Each timed step ends by reading its loss (``.item()``, a device sync), as
hybridlm's logged steps do, so both report the median of per-step throughputs.
"""
from __future__ import annotations

import gc
import time
from dataclasses import dataclass

import torch

from ..config import ModelConfig
from ..model.specs import build_model
from ..model.weights import init_parameters
from ..parallel.plan import LayerFactory
from ..parallel.state import SINGLE

BASELINES = ("torch", "torch-compile", "hf-zero2")


@dataclass
class Shape:
    model: ModelConfig
    micro_batch_size: int
    accumulation: int
    steps: int
    warmup: int
    lr: float = 1e-4

    @property
    def tokens_per_step(self) -> int:
        return self.micro_batch_size * self.accumulation * self.model.seq_length


def _batches(shape: Shape):
    v, s, b = shape.model.vocab_size, shape.model.seq_length, shape.micro_batch_size
    generator = torch.Generator(device="cuda").manual_seed(0)
    while True:
        tokens = torch.randint(0, v, (b, s + 1), device="cuda", generator=generator)
        yield tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def _time_steps(step, shape: Shape) -> dict:
    for _ in range(shape.warmup):
        step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    seconds = []
    for _ in range(shape.steps):
        start = time.perf_counter()
        final_loss = step().item()
        seconds.append(time.perf_counter() - start)
    return {"step_tokens_per_sec": [shape.tokens_per_step / s for s in seconds],
            "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30, "final_loss": final_loss}


def plain_pytorch(shape: Shape, *, compile: bool) -> dict:
    model = build_model(shape.model, LayerFactory(device="cuda", dtype=torch.float32))
    init_parameters(model, 1234, SINGLE)
    forward = torch.compile(model) if compile else model
    optimizer = torch.optim.AdamW(model.parameters(), lr=shape.lr, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
    batches = _batches(shape)

    def step():
        total = torch.zeros((), device="cuda")
        for _ in range(shape.accumulation):
            tokens, labels = next(batches)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = forward(tokens, labels) / shape.accumulation
            loss.backward()
            total += loss.detach()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return total

    try:
        return _time_steps(step, shape)
    finally:
        del model, forward, optimizer
        _release()


def hf_deepspeed_zero2(shape: Shape) -> dict:
    import deepspeed
    from transformers import LlamaConfig, LlamaForCausalLM
    m = shape.model
    config = LlamaConfig(hidden_size=m.hidden_size, intermediate_size=m.ffn_hidden_size, num_hidden_layers=m.num_layers,
                         num_attention_heads=m.num_attention_heads, num_key_value_heads=m.num_query_groups,
                         head_dim=m.kv_channels, vocab_size=m.padded_vocab_size or m.vocab_size,
                         max_position_embeddings=m.seq_length, rope_theta=m.rotary_base, rms_norm_eps=m.norm_epsilon,
                         tie_word_embeddings=not m.untie_embeddings_and_output_weights)
    config._attn_implementation = "sdpa"
    model = LlamaForCausalLM(config)
    ds_config = {"train_micro_batch_size_per_gpu": shape.micro_batch_size, "gradient_accumulation_steps": shape.accumulation,
                 "bf16": {"enabled": True}, "gradient_clipping": 1.0, "steps_per_print": 10**9,
                 "zero_optimization": {"stage": 2, "overlap_comm": True, "contiguous_gradients": True,
                                       "reduce_bucket_size": 5e8, "allgather_bucket_size": 5e8},
                 "optimizer": {"type": "AdamW", "params": {"lr": shape.lr, "betas": [0.9, 0.95], "weight_decay": 0.1}}}
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config)
    batches = _batches(shape)

    def step():
        total = torch.zeros((), device="cuda")
        for _ in range(shape.accumulation):
            tokens, labels = next(batches)
            # HF shifts labels itself; passing the inputs as labels trains on the same next-token task
            loss = engine(input_ids=tokens, labels=tokens).loss
            engine.backward(loss)
            engine.step()
            total += loss.detach() / shape.accumulation
        return total

    try:
        return _time_steps(step, shape)
    finally:
        engine.destroy()
        del engine, model
        _release()


def run_baseline(name: str, shape: Shape) -> dict:
    if name == "torch":
        return plain_pytorch(shape, compile=False)
    if name == "torch-compile":
        return plain_pytorch(shape, compile=True)
    if name == "hf-zero2":
        return hf_deepspeed_zero2(shape)
    raise ValueError(f"unknown baseline {name!r} (have: {', '.join(BASELINES)})")


def _release() -> None:
    gc.collect()
    torch.cuda.empty_cache()
