#!/usr/bin/env bash
# The fused kernels on the lent GPU machine, one device call (1 GPU; carry .device staged with `ds`), < 5 min:
#   1. the toolchain (nvcc, ninja) and `python -m hybridlm.ops.report` before any build
#   2. tests/test_ops_gpu.py: JIT-builds the CUDA extension, checks every kernel against fp32
#   3. the report again (now built) and benchmarks/kernels.py: eager vs torch.compile vs fused, GB/s vs copy
#   4. the reference model end to end with --fused-ops all and none (tokens/s)
# Rows for benchmarks/RESULTS.md land in $OUT/rows.md; logs in $OUT/logs.tar.gz.
set -uo pipefail
[ -n "${HYBRIDLM_DEVICE_READY:-}" ] || source .device/install.sh || exit 1
export PYTHONPATH=$PWD:${PYTHONPATH:-} OMP_NUM_THREADS=8
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT/logs"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
echo "nvcc: $(which nvcc || echo 'not on PATH')"; nvcc --version 2>/dev/null | tail -1
echo "ninja: $(which ninja || echo 'not on PATH')"
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
timeout 60 python3 -m hybridlm.ops.report > "$OUT/logs/report_before.log" 2>&1; echo "[report] rc=$?"; tail -7 "$OUT/logs/report_before.log"
timeout 300 python3 -m pytest tests/test_ops_gpu.py -q -p no:cacheprovider -rfEs > "$OUT/logs/test_ops_gpu.log" 2>&1
echo "[test_ops_gpu] rc=$? $(tail -1 "$OUT/logs/test_ops_gpu.log")"
grep -E "^(FAILED|ERROR|SKIPPED)|^E  " "$OUT/logs/test_ops_gpu.log" | head -15
grep -m1 "hybridlm: fused ops" "$OUT/logs/test_ops_gpu.log"
timeout 60 python3 -m hybridlm.ops.report > "$OUT/logs/report_after.log" 2>&1; echo "[report] rc=$?"; tail -6 "$OUT/logs/report_after.log"
timeout 240 python3 benchmarks/kernels.py --results-file "$OUT/rows.md" > "$OUT/logs/kernels.log" 2>&1
echo "[kernels] rc=$?"; grep -v "WARNING" "$OUT/logs/kernels.log" | tail -12
for ops in all none; do
  timeout 150 deepspeed --num_gpus 1 scripts/benchmark.py --model reference --steps 20 --warmup 6 \
    --label "1 GPU, ZeRO-1, bf16, --fused-ops $ops" --results-file "$OUT/rows.md" -- --bf16 --fused-ops "$ops" \
    --deepspeed_config ds_configs/zero1.json > "$OUT/logs/ref_fused_$ops.log" 2>&1
  echo "[reference --fused-ops $ops] rc=$? $(grep -h '^BENCH' "$OUT/logs/ref_fused_$ops.log")"
  grep -h -m1 "hybridlm: fused ops" "$OUT/logs/ref_fused_$ops.log"
  grep -h -m3 -E "Error|error:" "$OUT/logs/ref_fused_$ops.log" | head -3
done
tar -czf "$OUT/logs.tar.gz" -C "$OUT" logs && rm -rf "$OUT/logs"
echo "--- rows"; cat "$OUT/rows.md" 2>/dev/null
