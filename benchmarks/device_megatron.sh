#!/usr/bin/env bash
# Issue 20's GPU checks, in one device call on one H200 (carry .device staged with `ds te`):
#   1. the reference model (scripts/benchmark.py --model reference): tokens/s, and TFLOP/s/GPU and MFU
#      counted by Megatron-LM's num_floating_point_operations rule (bf16 ZeRO-1; FP8 as the headline row)
#   2. Megatron-LM's Llama-3 8B FP8 example script (tests/megatron_scripts/train_llama3_8b_h100_fp8.sh),
#      every flag as written (DTYPE fp8: --fp8-format hybrid, amax 1024/max, --fp8-param-gather; fused
#      attention; mock data), on one GPU with the 8B block cut to 4 layers and a 32768 vocabulary (so
#      that two checkpoints fit the disk): 10 steps, saved, then the script run again resumes to 20.
# From the repo root: bash benchmarks/device_megatron.sh [bench|l3|all]   (rows in $OUT/rows.md, logs in $OUT/logs.tar.gz);
# bench and l3 each fit one 10-minute device call.
set -uo pipefail
what=${1:-all}
source .device/install.sh || exit 1
export PYTHONPATH=$PWD:${PYTHONPATH:-} OMP_NUM_THREADS=8
REPO=$PWD
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT/logs"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
bench() {  # name args...
  local name=$1; shift
  timeout 300 deepspeed --num_gpus 1 scripts/benchmark.py --results-file "$OUT/rows.md" "$@" > "$OUT/logs/$name.log" 2>&1
  echo "[$name] rc=$? $(grep -h '^BENCH' "$OUT/logs/$name.log")"
  grep -h -m3 -E 'Error|error:' "$OUT/logs/$name.log" | head -3
}
if [ "$what" != l3 ]; then
bench ref_bf16 --model reference --steps 30 --warmup 8 --label "1 GPU, ZeRO-1, bf16 (Megatron FLOPs rule)" -- \
  --bf16 --deepspeed_config ds_configs/zero1.json
bench ref_fp8 --model reference --steps 30 --warmup 10 --label "1 GPU, ZeRO-1, FP8 hybrid, compiled (Megatron FLOPs rule)" -- \
  --bf16 --deepspeed_config ds_configs/zero1.json --transformer-impl transformer_engine --fp8-format hybrid \
  --fp8-amax-history-len 1024 --fp8-amax-compute-algo max --torch-compile
fi

if [ "$what" != bench ]; then
mkdir -p "$OUT/l3" && cd "$OUT/l3" || exit 1
L3=(env GPUS_PER_NODE=1 NUM_LAYERS=4 VOCAB_SIZE=32768 GLOBAL_BATCH_SIZE=8 LR_WARMUP_SAMPLES=16 LR_DECAY_SAMPLES=160
    EVAL_ITERS=2 EVAL_INTERVAL=10 SAVE_INTERVAL=1000 MASTER_PORT=29541)
timeout 600 "${L3[@]}" TRAIN_SAMPLES=80 bash "$REPO/tests/megatron_scripts/train_llama3_8b_h100_fp8.sh" ckpt tb > "$OUT/logs/l3_first.log" 2>&1
echo "[l3_first] rc=$? $(grep -c '^iter ' "$OUT/logs/l3_first.log") steps; $(grep -m1 -o 'attention [a-z]* ([^)]*)' "$OUT/logs/l3_first.log")"
timeout 600 "${L3[@]}" MASTER_PORT=29542 TRAIN_SAMPLES=160 bash "$REPO/tests/megatron_scripts/train_llama3_8b_h100_fp8.sh" ckpt tb > "$OUT/logs/l3_resume.log" 2>&1
echo "[l3_resume] rc=$? $(grep -c '^iter ' "$OUT/logs/l3_resume.log") steps; last: $(grep '^iter ' "$OUT/logs/l3_resume.log" | tail -1)"
grep -h '^hybridlm: --' "$OUT/logs/l3_first.log" | head -20
cp ckpt/config.yaml "$OUT/logs/l3_config.yaml" 2>/dev/null; ls profile 2>/dev/null
cd "$REPO" && rm -rf "$OUT/l3"
fi
tar -czf "$OUT/logs.tar.gz" -C "$OUT" logs && rm -rf "$OUT/logs"
echo "--- rows"; cat "$OUT/rows.md"
