#!/usr/bin/env bash
# MoE on the lent 2-GPU machine (carry .device staged with `ds`): the CUDA grouped-GEMM test,
# then an 8-expert top-2 model (Mixtral-8x7B layer shapes, 2 of 32 layers) at EP=2.
set -uo pipefail
source .device/install.sh || exit 1
export PYTHONPATH=$PWD:${PYTHONPATH:-} OMP_NUM_THREADS=8
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
timeout 120 python3 -m pytest tests/test_moe.py -m gpu -q -p no:cacheprovider > "$OUT/moe_test.log" 2>&1
tail -3 "$OUT/moe_test.log"
extra=""
grep -q " passed" "$OUT/moe_test.log" && ! grep -q "failed" "$OUT/moe_test.log" || extra="--no-moe-grouped-gemm"
label="EP=2, Mixtral-8x7B shape, 2 of 32 layers, gbs 16, ZeRO-1, bf16 $extra"
timeout 300 deepspeed --num_gpus 2 scripts/benchmark.py --model mixtral-8x7b --steps 20 --warmup 5 --label "$label" \
  --results-file "$OUT/rows.md" -- --num-layers 2 --expert-model-parallel-size 2 --global-batch-size 16 --bf16 \
  --deepspeed_config ds_configs/zero1.json $extra > "$OUT/moe.log" 2>&1
echo "rc=$? $(grep -h '^BENCH' "$OUT/moe.log")"; grep -E "Error|error:" "$OUT/moe.log" | head -5; grep -m3 "moe" "$OUT/moe.log" | head -3
cat "$OUT/rows.md" 2>/dev/null
