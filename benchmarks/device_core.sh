#!/usr/bin/env bash
# The core issue's GPU checks, in one device call on 2 H200s (carry .device staged with `ds`):
#   1. the reference model on one GPU (ZeRO-0 and ZeRO-1, bf16): tokens/s, MFU, peak memory
#   2. the reference model at TP=2 and PP=2 on two GPUs with NCCL, bf16
#   3. tests/test_gpu.py: 2-GPU TP+SP and PP runs track the 1-GPU run (bf16 and fp32)
# Rows for benchmarks/RESULTS.md land in $OUT/rows.md; logs in $OUT/logs.tar.gz.
set -uo pipefail
source .device/install.sh || exit 1
export PYTHONPATH=$PWD:${PYTHONPATH:-} OMP_NUM_THREADS=8
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT/logs"
nvidia-smi --query-gpu=name,memory.total,clocks.sm --format=csv
python3 -c "import torch, deepspeed; print('torch', torch.__version__, 'deepspeed', deepspeed.__version__, 'gpus', torch.cuda.device_count())"
bench() {  # name gpus args...
  local name=$1 gpus=$2; shift 2
  timeout 240 deepspeed --num_gpus "$gpus" scripts/benchmark.py --results-file "$OUT/rows.md" "$@" > "$OUT/logs/$name.log" 2>&1
  echo "[$name] rc=$? $(grep -h '^BENCH' "$OUT/logs/$name.log")"
  grep -h -m3 -E 'Error|error:' "$OUT/logs/$name.log" | head -3
}
bench ref_zero0 1 --model reference --steps 30 --warmup 8 --label "1 GPU, ZeRO-0, bf16" -- --bf16 --deepspeed_config ds_configs/zero0.json
bench ref_zero1 1 --model reference --steps 30 --warmup 8 --label "1 GPU, ZeRO-1, bf16" -- --bf16 --deepspeed_config ds_configs/zero1.json
bench ref_tp2 2 --model reference --steps 30 --warmup 8 --label "TP=2 SP, ZeRO-1, bf16" -- --bf16 --tensor-model-parallel-size 2 --sequence-parallel --deepspeed_config ds_configs/zero1.json
bench ref_pp2 2 --model reference --steps 20 --warmup 5 --label "PP=2, gbs 32 (8 micro-batches), ZeRO-1, bf16" -- --bf16 --pipeline-model-parallel-size 2 --global-batch-size 32 --deepspeed_config ds_configs/zero1.json
timeout 300 python3 -m pytest tests/test_gpu.py -q -p no:cacheprovider > "$OUT/logs/test_gpu.log" 2>&1
echo "[test_gpu] rc=$? $(tail -1 "$OUT/logs/test_gpu.log")"
tar -czf "$OUT/logs.tar.gz" -C "$OUT" logs && rm -rf "$OUT/logs"
echo "--- rows"; cat "$OUT/rows.md"
