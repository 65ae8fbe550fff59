"""Process groups: one object built from DeepSpeed's topology, passed to whoever needs a group.

Rank order is Megatron's: TP innermost (consecutive ranks: one node's NVLink island), then
context parallelism (CP), then DP, then PP outermost, so TP and CP groups stay inside a node
as long as TP x CP fits in one. It is DeepSpeed's ``PipeModelDataParallelTopology`` (axes
pipe, data, model) with a data axis of DP x CP ranks, CP inside it: to DeepSpeed a CP rank is
one more data-parallel replica (same weights, its own slice of every sample), so DeepSpeed's
data-parallel group (``grad_reduction``: gradient averaging, ZeRO partitioning, the pipeline
engine's groups) is DP x CP, while ``dp`` (which samples a rank reads) and ``cp`` (which slice of
them) are the two factors. Expert parallelism (EP) is carved out of that data axis: each
data group is cut into consecutive chunks of EP ranks (the EP groups); ranks at the same
position in each chunk form the expert-data-parallel group that reduces expert gradients.

The rank lists are pure functions of the sizes (``layout_groups``) so they can be tested
without a cluster; ``ParallelState`` turns them into torch process groups, and also
answers DeepSpeed's ``mpu`` interface (ZeRO, activation checkpointing and the gradient
norm ask it for the model- and data-parallel groups).
"""
from __future__ import annotations

from dataclasses import dataclass
import torch.distributed as dist
from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology, PipelineParallelGrid


@dataclass(frozen=True)
class GroupHandle:
    """A process group with this rank's place in it. ``group=None`` means a group of one."""
    group: object
    rank: int
    size: int


SINGLE = GroupHandle(None, 0, 1)


def make_topology(tp: int, pp: int, dp: int) -> PipeModelDataParallelTopology:
    return PipeModelDataParallelTopology(num_pp=pp, num_mp=tp, num_dp=dp)


def layout_groups(tp: int, pp: int, dp: int, ep: int = 1, cp: int = 1) -> dict[str, list[list[int]]]:
    """Every group of each kind as lists of global ranks: TP innermost, then CP, DP, PP.
    ``grad_reduction`` is DeepSpeed's data-parallel axis (DP x CP); ``cp`` and ``dp`` split it."""
    topo = make_topology(tp, pp, dp * cp)
    data = topo.get_axis_comm_lists("data")  # data index = dp rank * CP + cp rank
    groups = {"tp": topo.get_axis_comm_lists("model"), "grad_reduction": data, "pp": topo.get_axis_comm_lists("pipe"),
              "cp": [ranks[i:i + cp] for ranks in data for i in range(0, dp * cp, cp)],
              "dp": [ranks[i::cp] for ranks in data for i in range(cp)], "ep": [], "expert_dp": []}
    for data_ranks in data:
        chunks = [data_ranks[i:i + ep] for i in range(0, dp * cp, ep)]
        groups["ep"] += chunks
        groups["expert_dp"] += [list(column) for column in zip(*chunks)]
    return groups


class ParallelState:
    """The process groups of one run. Build it once after ``init_process_group``."""

    def __init__(self, tp: int = 1, pp: int = 1, dp: int = 1, ep: int = 1, cp: int = 1):
        self.sizes = dict(tp=tp, pp=pp, dp=dp, ep=ep, cp=cp)
        self.topology = make_topology(tp, pp, dp * cp)
        world = tp * pp * dp * cp
        if not dist.is_initialized():
            if world != 1:
                raise RuntimeError(f"a layout of {world} ranks needs torch.distributed to be initialised first")
            self.grid = None
            self.tp = self.dp = self.cp = self.grad_reduction = self.pp = self.ep = self.expert_dp = SINGLE
            self.global_rank, self.stage = 0, 0
            return
        if dist.get_world_size() != world:
            raise RuntimeError(f"world size {dist.get_world_size()} != TP x PP x DP x CP = {tp} x {pp} x {dp} x {cp}")
        self.global_rank = dist.get_rank()
        # DeepSpeed's grid builds the TP ('slice'), data (DP x CP), PP and TP x PP groups; ZeRO and
        # the pipeline engine take their groups from an object like it, so ours are the same ranks.
        self.grid = PipelineParallelGrid(topology=self.topology)
        self.stage = self.grid.get_stage_id()
        self.tp = GroupHandle(self.grid.get_slice_parallel_group(), self.grid.get_slice_parallel_rank(), tp)
        # DeepSpeed's data-parallel group, DP x CP: the ranks it averages dense gradients over and
        # partitions ZeRO state over. A loss normalised by a global count (fine-tuning) sums that
        # count over it; so do statistics of what each rank routed or computed (MoE, DPO metrics).
        self.grad_reduction = GroupHandle(self.grid.get_data_parallel_group(), self.grid.get_data_parallel_rank(), dp * cp)
        self.pp = GroupHandle(self.grid.get_pipe_parallel_group(), self.stage, pp)
        lists = layout_groups(tp, pp, dp, ep, cp)
        if cp == 1:
            self.dp, self.cp = self.grad_reduction, SINGLE
        else:
            self.dp = self._new_groups(lists["dp"])
            self.cp = self._new_groups(lists["cp"])
        self.ep = self._new_groups(lists["ep"])
        self.expert_dp = self._new_groups(lists["expert_dp"])

    def _new_groups(self, rank_lists: list[list[int]]) -> GroupHandle:
        mine = SINGLE
        for ranks in rank_lists:  # every rank must create every group, in the same order
            group = dist.new_group(ranks=ranks)
            if self.global_rank in ranks:
                mine = GroupHandle(group, ranks.index(self.global_rank), len(ranks))
        return mine

    @property
    def is_first_stage(self) -> bool:
        return self.stage == 0

    @property
    def is_last_stage(self) -> bool:
        return self.stage == self.sizes["pp"] - 1

    def __repr__(self) -> str:
        return (f"ParallelState(rank={self.global_rank}, tp={self.tp.rank}/{self.tp.size}, pp={self.pp.rank}/{self.pp.size}, "
                f"dp={self.dp.rank}/{self.dp.size}, cp={self.cp.rank}/{self.cp.size}, ep={self.ep.rank}/{self.ep.size})")

    # ---- DeepSpeed's mpu interface (ZeRO, gradient norm, activation checkpointing). Its
    # "data parallel" is the DP x CP group: CP ranks hold the same weights, so their gradients
    # are averaged and their ZeRO state partitioned together with the DP replicas'.
    def get_model_parallel_rank(self) -> int:
        return self.grid.get_model_parallel_rank() if self.grid else 0

    def get_model_parallel_world_size(self) -> int:
        return self.grid.get_model_parallel_world_size() if self.grid else 1

    def get_model_parallel_group(self):
        return self.grid.get_model_parallel_group() if self.grid else None

    def get_tensor_model_parallel_rank(self) -> int:
        return self.tp.rank

    def get_tensor_model_parallel_world_size(self) -> int:
        return self.tp.size

    def get_tensor_model_parallel_group(self):
        return self.tp.group

    def get_slice_parallel_rank(self) -> int:
        return self.tp.rank

    def get_slice_parallel_world_size(self) -> int:
        return self.tp.size

    def get_slice_parallel_group(self):
        return self.tp.group

    def get_data_parallel_rank(self) -> int:
        return self.grad_reduction.rank

    def get_data_parallel_world_size(self) -> int:
        return self.grad_reduction.size

    def get_data_parallel_group(self):
        return self.grad_reduction.group

    def get_pipe_parallel_rank(self) -> int:
        return self.pp.rank

    def get_pipe_parallel_world_size(self) -> int:
        return self.pp.size

    def get_pipe_parallel_group(self):
        return self.pp.group

    def get_pipeline_model_parallel_rank(self) -> int:
        return self.pp.rank

    def get_pipeline_model_parallel_world_size(self) -> int:
        return self.pp.size

    def get_pipeline_model_parallel_group(self):
        return self.pp.group
