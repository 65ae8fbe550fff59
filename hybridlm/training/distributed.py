"""Start torch.distributed through DeepSpeed: NCCL on GPUs, gloo on CPUs, a bounded timeout."""
from __future__ import annotations

import datetime
import os
import socket

import deepspeed
import deepspeed.ops
from deepspeed.accelerator import get_accelerator

from ..config import ConfigError


def on_gpu() -> bool:
    return get_accelerator().device_name() == "cuda"


def _free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _mpi_rendezvous() -> None:
    """``mpirun`` without torch's variables: DeepSpeed's MPI discovery (mpi4py) sets RANK,
    WORLD_SIZE, LOCAL_RANK and MASTER_ADDR (rank 0's first address); the port is one that rank 0
    finds free, broadcast the same way, instead of DeepSpeed's fixed 29500 that two jobs on one
    host would share. MASTER_ADDR / MASTER_PORT passed to mpirun (``-x``) win."""
    from deepspeed.comm.comm import mpi_discovery
    from mpi4py import MPI
    given = {k: os.environ[k] for k in ("MASTER_ADDR", "MASTER_PORT") if k in os.environ}
    comm = MPI.COMM_WORLD
    port = given.get("MASTER_PORT") or comm.bcast(str(_free_port("")) if comm.Get_rank() == 0 else None, root=0)
    mpi_discovery(distributed_port=int(port), verbose=False)
    os.environ.update(given)


def init_distributed(timeout_minutes: float) -> None:
    """Join the process group the launcher described (or a group of one for ``python script.py``)."""
    if "RANK" not in os.environ and ("OMPI_COMM_WORLD_RANK" in os.environ or "PMI_RANK" in os.environ):
        _mpi_rendezvous()
    if "RANK" not in os.environ and "OMPI_COMM_WORLD_RANK" not in os.environ and "PMI_RANK" not in os.environ:
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
    if not on_gpu():
        # On CPU DeepSpeed compiles a shared-memory all-reduce (~1 min) at start-up that only
        # its inference path calls; training collectives go through gloo. Skip the build. Reading
        # deepspeed.ops.__compatible_ops__ would first probe every op (a C compile for async_io, ~1 s a
        # process); the shm check is its only reader in a training process and defaults to False.
        vars(deepspeed.ops).setdefault("__compatible_ops__", {})["deepspeed_shm_comm"] = False
    try:
        deepspeed.init_distributed(dist_backend="nccl" if on_gpu() else "gloo",
                                   timeout=datetime.timedelta(minutes=timeout_minutes), verbose=False)
    except RuntimeError as e:
        if "EADDRINUSE" not in str(e) and "ddress already in use" not in str(e):
            raise
        raise ConfigError(f"the rendezvous port {os.environ.get('MASTER_PORT')} on {os.environ.get('MASTER_ADDR')} is taken by "
                          "another process (another job?): give the launcher a free one (deepspeed --master_port N, torchrun "
                          "--master-port N; python scripts/pretrain.py picks one itself).") from None
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if on_gpu():
        get_accelerator().set_device(local_rank)


def device():
    return get_accelerator().current_device_name()
