#!/usr/bin/env bash
# Issue 7 (checkpoint interoperability) on 4 GPUs (kind nvidia-h200-x4; carry .device staged with `ds`).
#   bash benchmarks/device_interop.sh tests   # tests/test_{convert,reshape,generate}.py on the GPUs (NCCL, fp32)
#   bash benchmarks/device_interop.sh check   # benchmarks/interop_check.py: bf16 reshape table, export logits, generation
# Two calls, each under the 10-minute limit. Logs in $OUT/logs.tar.gz; the table is printed last.
set -uo pipefail
source .device/install.sh || exit 1
export PYTHONPATH=$PWD:${PYTHONPATH:-} OMP_NUM_THREADS=8
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT/logs"
nvidia-smi --query-gpu=name,memory.total --format=csv
python3 -c "import torch, deepspeed, transformers; print('torch', torch.__version__, 'deepspeed', deepspeed.__version__, 'transformers', transformers.__version__, 'gpus', torch.cuda.device_count())"
case "${1:-check}" in
  tests)
    timeout 560 python3 -m pytest tests/test_convert.py tests/test_reshape.py tests/test_generate.py -q -p no:cacheprovider --durations=10 \
      > "$OUT/logs/tests.log" 2>&1
    echo "[tests] rc=$?"; tail -25 "$OUT/logs/tests.log" ;;
  check)
    timeout 560 python3 benchmarks/interop_check.py --out "$OUT" 2>&1 | tee "$OUT/logs/check.log" | tail -20 ;;
esac
rm -rf "$OUT/ck" "$OUT/hf"
tar -czf "$OUT/logs.tar.gz" -C "$OUT" logs && rm -rf "$OUT/logs"
