#!/usr/bin/env bash
# The GPU-only tests (tests/test_gpu.py) on the lent 2-GPU machine (carry .device staged with `ds`).
set -uo pipefail
source .device/install.sh || exit 1
export PYTHONPATH=$PWD:${PYTHONPATH:-} OMP_NUM_THREADS=8
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -c "import torch; print('gpus', torch.cuda.device_count(), torch.cuda.get_device_name())"
timeout 540 python3 -m pytest tests/test_gpu.py -v -p no:cacheprovider -rA 2>&1 | tee "$OUT/test_gpu.log" | grep -E "PASSED|FAILED|SKIPPED|ERROR|passed|failed|^E " | head -40
