"""GRPO's rollouts on the live training weights, and its reference weights: no second model.

Sampling (``Sampler``) decodes with ``hybridlm.model.generation`` over the engine's own module, in
eval mode (no dropout). Under ZeRO-3 every parameter is gathered once for the whole rollout, as
TRL does by default (``ds3_gather_for_generation``), with DeepSpeed's partitioning hooks lifted
meanwhile (they would release each parameter after its module ran, and gather it again per token:
an all-gather over DP that replicas stopping after different numbers of tokens would never meet).
The cost is the rank's TP shard of the weights whole, for the rollout's duration.

Each DP replica draws from its own stream (``--seed`` and its DP rank); its TP ranks draw the same
numbers and take the same token (the best of every rank's share of the vocabulary), its CP ranks
decode the same rows and keep CP rank 0's completions. The stream's state is saved with every checkpoint (``state``), so a resumed run samples
what the uninterrupted one would have.

The reference (``--beta`` > 0): with LoRA, the same model with its adapters switched off; else
``FrozenWeights``, a copy of this rank's share of the starting weights (under ZeRO-3 its partition),
swapped into the parameters in place for the reference pass and back. It costs one copy of the
rank's weights in the training dtype: 2 bytes a parameter in bf16 (about 1 GB for a 0.5B model at
TP 1; 1/DP of that under ZeRO-3), and a parameter's worth of scratch while swapping.
"""
from __future__ import annotations

import contextlib
from typing import Sequence

import torch
import torch.distributed as dist

from ..model.generation import Completions, Generator, Sampling
from ..parallel.lora import adapters_disabled
from .distributed import device


def zero_stage(engine) -> int:
    return int(engine.zero_optimization_stage() or 0)


@contextlib.contextmanager
def decoding_weights(engine):
    """The engine's module ready to decode: eval mode; under ZeRO-3 gathered, hooks lifted (TRL's way)."""
    module = engine.module
    module.eval()
    try:
        if zero_stage(engine) != 3:
            yield module
            return
        import deepspeed
        offload = engine.optimizer.parameter_offload
        with deepspeed.zero.GatheredParameters(list(module.parameters())):
            for param in module.parameters():
                param.ds_active_sub_modules.clear()
            for hook in offload.forward_hooks + offload.backward_hooks:
                hook.remove()
            offload.forward_hooks, offload.backward_hooks = [], []
            try:
                yield module
            finally:
                offload._register_deepspeed_module(offload.module)  # invalidates the parameter coordinator's trace
    finally:
        module.train()


class Sampler:
    """Completions of a DP replica's prompts on the live weights, from the replica's own random stream."""

    def __init__(self, run, sampling: Sampling, max_new_tokens: int, stop_ids: Sequence[int], pad_id: int):
        self.sampling, self.max_new_tokens, self.stop_ids, self.pad_id = sampling, max_new_tokens, tuple(stop_ids), pad_id
        self.decoder = Generator(run.engine.module, run.ps.tp, run.cfg.model.vocab_size)
        self.stream = torch.Generator(device=device())
        self.stream.manual_seed((sampling.seed * 1_000_003 + run.ps.dp.rank) % 2**63)

    def sample(self, run, prompts: list) -> Completions:
        with decoding_weights(run.engine):
            out = self.decoder.generate_batch(prompts, self.max_new_tokens, self.sampling, stop_ids=self.stop_ids,
                                              pad_id=self.pad_id, generator=self.stream)
        cp = run.ps.cp
        if cp.size > 1:  # the CP ranks decoded the same rows; they keep one rank's, whatever rounding each saw
            shared = [out]
            dist.broadcast_object_list(shared, src=dist.get_global_rank(cp.group, 0), group=cp.group)
            out = shared[0]
        return out

    def state(self) -> torch.Tensor:
        return self.stream.get_state()

    def load_state(self, state: torch.Tensor) -> None:
        self.stream.set_state(state)


class FrozenWeights:
    """A copy of this rank's share of ``engine``'s weights as they are now, swapped in by ``swapped_in``."""

    @torch.no_grad()
    def __init__(self, engine):
        self.pairs = [(live, live.detach().clone()) for live in map(_local_storage, engine.module.parameters())]

    @torch.no_grad()
    def _swap(self) -> None:
        for live, frozen in self.pairs:  # one parameter at a time: no second full copy, even briefly
            scratch = live.clone()
            live.copy_(frozen)
            frozen.copy_(scratch)

    @contextlib.contextmanager
    def swapped_in(self, engine):
        release = zero_stage(engine) == 3  # no gathered copy may outlive the swap
        if release:
            engine.empty_partition_cache()
        self._swap()
        try:
            yield
        finally:
            if release:
                engine.empty_partition_cache()
            self._swap()

    @property
    def bytes(self) -> int:
        return sum(frozen.numel() * frozen.element_size() for _, frozen in self.pairs)


def _local_storage(param: torch.Tensor) -> torch.Tensor:
    """What holds this rank's values of a parameter: under ZeRO-3 its partition, else the parameter."""
    return param.ds_tensor if hasattr(param, "ds_tensor") else param.data


def reference_context(engine, frozen: FrozenWeights | None):
    """The context in which the engine computes the reference: adapters off (LoRA), or the frozen weights in."""
    return adapters_disabled(engine.module) if frozen is None else frozen.swapped_in(engine)
