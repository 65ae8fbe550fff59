#!/usr/bin/env bash
# The memory planner against torch.cuda.max_memory_allocated on the lent GPU machine (1-4 H200s,
# carry .device staged with `ds`; ~3-4 minutes). Each run trains a few steps through the real
# trainer in benchmarks/plan_check.py, which prints the worst rank's measured peak beside the
# planner's figure for the same flags (line "PLAN ...") and appends a row to $OUT/rows.md.
# Fused kernels off (--fused-ops none): no JIT build inside the time budget; the planner is told.
set -uo pipefail
source .device/install.sh || exit 1
export PYTHONPATH=$PWD:${PYTHONPATH:-} OMP_NUM_THREADS=8
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT/logs"
GPUS=$(python3 -c "import torch; print(torch.cuda.device_count())")
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | head -1
echo "GPUs: $GPUS"
check() {  # name gpus label -- pretrain flags
  local name=$1 gpus=$2 label=$3; shift 3
  if [ "$gpus" -gt "$GPUS" ]; then echo "[$name] skipped: needs $gpus GPUs"; return; fi
  timeout 110 deepspeed --num_gpus "$gpus" --master_port $((29500 + RANDOM % 1000)) benchmarks/plan_check.py \
    --label "$label" --results-file "$OUT/rows.md" "$@" > "$OUT/logs/$name.log" 2>&1
  echo "[$name] rc=$? $(grep -h '^PLAN' "$OUT/logs/$name.log")"
  grep -h -m3 -E 'Error|error:' "$OUT/logs/$name.log" | head -3
}
COMMON="--fused-ops none --bf16 --train-iters 3 --log-interval 1 --lr-warmup-iters 0"
# The reference model (944M, d2048 L16, seq 2048, micro-batch 4).
check ref_zero0 1 "1 GPU, ZeRO-0" -- --model reference $COMMON --deepspeed_config ds_configs/zero0.json
check ref_tp2 2 "TP=2 SP, ZeRO-1" -- --model reference $COMMON --tensor-model-parallel-size 2 --sequence-parallel --deepspeed_config ds_configs/zero1.json
check ref_pp2 2 "PP=2, gbs 32 (8 micro-batches), ZeRO-1" -- --model reference $COMMON --pipeline-model-parallel-size 2 --global-batch-size 32 --deepspeed_config ds_configs/zero1.json
check ref_zero3 2 "DP=2, ZeRO-3" -- --model reference $COMMON --deepspeed_config ds_configs/zero3.json
# Llama 2 7B's layer shapes (d4096, seq 4096, vocab 32000), 4 of 32 layers.
check 7b_zero1 1 "llama2-7b shape, 4 of 32 layers, 1 GPU, ZeRO-1" -- --model llama2-7b --num-layers 4 $COMMON --deepspeed_config ds_configs/zero1.json
check 7b_tp2_full 2 "llama2-7b shape, 4 of 32 layers, TP=2 SP, full recompute, ZeRO-1" -- --model llama2-7b --num-layers 4 $COMMON --tensor-model-parallel-size 2 --sequence-parallel --recompute-granularity full --deepspeed_config ds_configs/zero1.json
tar -czf "$OUT/logs.tar.gz" -C "$OUT" logs && rm -rf "$OUT/logs"
echo "--- rows"; cat "$OUT/rows.md" 2>/dev/null
