#!/usr/bin/env bash
# Issue 10 on one 8-GPU H200 host (device kind nvidia-h200-x8), one mode per device call:
#   dense  a 1.3B Llama-style model (the reference block, 24 layers): 200 steps on 1 GPU, then the same
#          200 steps at TP=2 SP x PP=2 x DP=2 (ZeRO-1, bf16, compiled), the two loss curves compared,
#          then tokens/s, MFU and peak memory per GPU of the 8-GPU layout
#   moe    a Mixtral-style model (8 experts, top-2, d1024 L16, 1.5B parameters): 200 steps on 1 GPU,
#          then at EP=4 x DP=8 (ZeRO-1, bf16), compared, then its speed and memory
# Same seed, data (the built-in corpus) and global batch in both runs of a pair, so the curves differ by
# rounding only. From the repo root, with .device staged (`../shared/device/stage.sh ds`):
#   bash benchmarks/device_8gpu.sh dense|moe      (rows land in $OUT/rows.md, curves and logs in $OUT)
set -uo pipefail
source .device/install.sh || exit 1
export HYBRIDLM_DEVICE_READY=1 PYTHONPATH=$PWD:${PYTHONPATH:-} OMP_NUM_THREADS=8
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT/logs"
what=${1:?dense or moe}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | head -1
source benchmarks/device_common.sh

DEVICE="8x H200"
COMMON=(--bf16 --deepspeed_config ds_configs/zero1.json --train-iters 200 --lr 3e-4 --min-lr 3e-5 --lr-warmup-iters 20
        --log-interval 1 --seed 1234)
if [ "$what" = dense ]; then
  SHAPE_FLAGS=(--num-layers 24 --torch-compile)
  SHAPE="reference block d2048 L24 (1.3B), seq 2048"
  PARALLEL=(--tensor-model-parallel-size 2 --sequence-parallel --pipeline-model-parallel-size 2)
  GBS=32 ONE_GPU_LIMIT=330
  LAYOUT="TP=2 SP x PP=2 x DP=2, ZeRO-1, bf16, --torch-compile"
elif [ "$what" = moe ]; then
  SHAPE_FLAGS=(--num-layers 16 --hidden-size 1024 --num-attention-heads 16 --group-query-attention --num-query-groups 8 --ffn-hidden-size 3584
               --num-experts 8 --moe-router-topk 2 --moe-aux-loss-coeff 0.02 --micro-batch-size 2)
  SHAPE="Mixtral-style d1024 L16, 8 experts top-2 (1.5B, 0.5B active), seq 2048"
  PARALLEL=(--expert-model-parallel-size 4)
  GBS=16 ONE_GPU_LIMIT=380
  LAYOUT="EP=4 x DP=8, ZeRO-1, bf16"
else
  echo "unknown mode $what (dense or moe)" >&2; exit 2
fi

train() {  # name gpus(include list) port timeout flags...
  local name=$1 gpus=$2 port=$3 limit=$4; shift 4
  timeout "$limit" deepspeed --include "localhost:$gpus" --master_port "$port" scripts/pretrain.py --model reference "${SHAPE_FLAGS[@]}" \
      "${COMMON[@]}" --global-batch-size "$GBS" "$@" \
      --metrics-file "$OUT/${what}_$name.jsonl" > "$OUT/logs/${what}_$name.log" 2>&1
  echo "[$name] rc=$? $(grep -h -E '^iter +200/' "$OUT/logs/${what}_$name.log")"
  grep -h -E 'Error|error:' "$OUT/logs/${what}_$name.log" | tail -3
}
train one_gpu 0 29600 "$ONE_GPU_LIMIT"
train eight_gpus 0,1,2,3,4,5,6,7 29601 120 "${PARALLEL[@]}"
python3 scripts/compare_runs.py "$OUT/${what}_one_gpu.jsonl" "$OUT/${what}_eight_gpus.jsonl" --window 10 --skip 10 --tolerance 0.03 \
    --results-file "$OUT/rows_${what}_curve.md" --device "$DEVICE" --model "$SHAPE" --layout "$LAYOUT, gbs $GBS, 200 steps vs 1 GPU"
echo "[compare] rc=$?"
bench "${what}_speed" 0,1,2,3,4,5,6,7 29602 120 --model reference --steps 10 --warmup 4 --label "$LAYOUT, gbs 64" -- \
    "${SHAPE_FLAGS[@]}" "${PARALLEL[@]}" --global-batch-size 64 --bf16 --deepspeed_config ds_configs/zero1.json

cat "$OUT"/rows_*.md > "$OUT/rows.md" 2>/dev/null
tar -czf "$OUT/logs.tar.gz" -C "$OUT" logs && rm -rf "$OUT/logs" "$OUT"/rows_*.md
echo "--- rows"; cat "$OUT/rows.md" 2>/dev/null
