"""Test-session set-up: CPU DeepSpeed, one thread per rank, and the repo importable."""
import os
import sys

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("WANDB_MODE", "offline")
# One shared cache for DeepSpeed's JIT-built ops (async_io for NVMe: minutes once, seconds after).
os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.expanduser("~/.cache/hybridlm/torch_extensions"))
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), HERE]

# Import the heavy libraries once in the parent: forked ranks inherit them (see harness.py).
import torch  # noqa: E402

if not torch.cuda.is_available():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # on the GPU machine DeepSpeed must pick CUDA
import deepspeed  # noqa: E402,F401

import hybridlm.training.trainer  # noqa: E402,F401
