"""Do the replicas still hold the same weights? (``--check-weight-hash-across-dp-replicas-interval N``, Megatron's flag.)

Data-parallel and context-parallel ranks of one TP/PP shard hold the same dense weights, and the ranks of one
expert-data-parallel group the same experts. Nothing in a healthy run makes them differ; a faulty GPU, a
non-deterministic update applied on one rank only, or a bug in how ZeRO gathers its partitions would, and the run
would go on training several models that it averages as one. Every N steps (and once after start-up or a resume,
as Megatron checks) each rank hashes what it holds, the replicas compare, and a mismatch stops every rank with one
sentence naming the iteration, the ranks and the first parameter that differs.

The hash is exact and cheap: each parameter's bit pattern as integers, multiplied by a fixed pseudo-random
position-dependent weight and summed in int64 (wrap-around arithmetic, so the sum is the same in any order), on the
device, one chunk at a time; then one all-gather of a vector of int64s per replica group. Megatron hashes with
SHA-256 on the host, which copies every parameter to the CPU. Under ZeRO-3 each rank holds a partition no other
rank has: only the parameters it keeps whole (DeepSpeed's persistent small ones) have replicas to compare.
"""
from __future__ import annotations

import time
from typing import Optional

import torch
import torch.distributed as dist

from ..parallel.state import GroupHandle

_CHUNK = 1 << 22  # elements hashed at once: a 32 MiB int64 temporary and a 32 MiB weight vector
_BITS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class ReplicasDiverged(RuntimeError):
    """Replicas that must hold the same weights do not; the message is one sentence."""


def _is_partitioned(param: torch.nn.Parameter) -> bool:
    """A ZeRO-3 parameter whose rank holds only its own partition (not one of DeepSpeed's persistent whole ones)."""
    return hasattr(param, "ds_id") and not getattr(param, "ds_persist", False)


def _is_expert(param: torch.nn.Parameter) -> bool:
    return getattr(param, "allreduce", True) is False  # DeepSpeed's mark on expert parameters (hybridlm.parallel.moe)


class ReplicaCheck:
    """Hashes a model's parameters and compares them across the replica groups (dense: ``grad_reduction``, DP x CP;
    experts: ``expert_dp``). Build once; ``check`` is collective over the whole world."""

    def __init__(self, module: torch.nn.Module, grad_reduction: GroupHandle, expert_dp: GroupHandle):
        named = [(name, p) for name, p in module.named_parameters() if not _is_partitioned(p)]
        self.partitioned = sum(1 for p in module.parameters() if _is_partitioned(p))
        self.groups = [(grad_reduction, [(n, p) for n, p in named if not _is_expert(p)]),
                       (expert_dp, [(n, p) for n, p in named if _is_expert(p)])]
        self._weights: Optional[torch.Tensor] = None
        self.last_seconds = 0.0

    def _position_weights(self, device) -> torch.Tensor:
        if self._weights is None or self._weights.device != device:
            generator = torch.Generator().manual_seed(0x5EED)
            self._weights = (torch.randint(1, 1 << 31, (_CHUNK,), generator=generator, dtype=torch.int64) | 1).to(device)
        return self._weights

    @torch.no_grad()
    def tensor_hash(self, tensor: torch.Tensor) -> torch.Tensor:
        """A 0-dim int64 on the tensor's device: equal for bit-identical tensors; any changed, swapped or moved
        element changes it (short of a 2^-64 coincidence)."""
        flat = tensor.detach().contiguous().view(-1)
        bits = flat.view(_BITS[flat.element_size()])
        weights = self._position_weights(flat.device)
        total = torch.zeros((), dtype=torch.int64, device=flat.device)
        for start in range(0, bits.numel(), _CHUNK):
            part = bits[start:start + _CHUNK].to(torch.int64)
            total = total * 1_000_003 + (part * weights[:part.numel()]).sum()
        return total

    def check(self, iteration: int) -> None:
        """Raise ReplicasDiverged on every rank if any replica group disagrees."""
        started = time.perf_counter()
        problem = None
        for group, named in self.groups:
            if group.size == 1 or not named:
                continue
            mine = torch.stack([self.tensor_hash(p) for _, p in named])
            everyone = [torch.empty_like(mine) for _ in range(group.size)]
            dist.all_gather(everyone, mine, group=group.group)
            everyone = torch.stack(everyone)  # [replicas, parameters]
            differs = (everyone != everyone[0]).any(dim=0)
            if problem is None and bool(differs.any()):
                problem = _describe(iteration, group, named, everyone, int(differs.nonzero()[0]))
        self.last_seconds = time.perf_counter() - started
        if dist.is_initialized() and dist.get_world_size() > 1:  # every rank stops, not only the replicas that saw it
            found = torch.tensor([problem is not None], dtype=torch.int32, device=_device_of(self.groups))
            dist.all_reduce(found, op=dist.ReduceOp.MAX)
            if found.item():
                messages = [None] * dist.get_world_size()
                dist.all_gather_object(messages, problem)
                problem = next(m for m in messages if m)
        if problem:
            raise ReplicasDiverged(problem)

    def describe(self) -> str:
        dense, experts = (len(named) for _, named in self.groups)
        what = f"{dense} dense parameters across DP x CP" + (f", {experts} expert ones across expert-DP" if experts else "")
        if self.partitioned:
            what += f"; {self.partitioned} ZeRO-3 partitions have no replicas"
        return what


def _device_of(groups) -> torch.device:
    for _, named in groups:
        for _, p in named:
            return p.device
    from deepspeed.accelerator import get_accelerator
    return torch.device(get_accelerator().current_device_name())


def _describe(iteration: int, group: GroupHandle, named: list, hashes: torch.Tensor, index: int) -> str:
    """One sentence: which ranks hold which value of the first parameter that differs (a majority is named as the
    reference; with no majority, e.g. two replicas, no side is called wrong)."""
    ranks = dist.get_process_group_ranks(group.group)
    by_value: dict[int, list[int]] = {}
    for i, value in enumerate(hashes[:, index].tolist()):
        by_value.setdefault(value, []).append(ranks[i])
    sides = sorted(by_value.values(), key=lambda side: (-len(side), side))
    if len(sides[0]) > len(sides[1]):
        who = f"ranks {sorted(r for side in sides[1:] for r in side)} hold another value than ranks {sides[0]}"
    else:
        who = " and ".join(f"ranks {side}" for side in sorted(sides)) + " hold different values"
    return (f"iteration {iteration}: replicas that must hold the same weights differ, first at {named[index][0]}: {who} "
            "(--check-weight-hash-across-dp-replicas-interval); stopping before the run trains diverged copies further.")
