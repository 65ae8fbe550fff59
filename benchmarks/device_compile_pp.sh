#!/usr/bin/env bash
# On 2 GPUs: compiled PP=2 tracks the compiled 1-GPU run in fp32 (tests/test_gpu.py).
source .device/install.sh >/dev/null 2>&1; export PYTHONPATH=$PWD:$PYTHONPATH
timeout 230 python3 -m pytest -q -s -p no:cacheprovider tests/test_gpu.py -k torch_compile_under_pp2 2>&1 | grep -E "GPU:|TP=2 SP:|passed|failed|^E  " | head -20
