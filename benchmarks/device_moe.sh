#!/usr/bin/env bash
# MoE on one lent H200 (carry .device staged with `ds te`):
#   1. the MoE GPU tests: grouped GEMM in bf16 equals the expert loop; the dropless EP=1 layer
#      never waits on the host (torch.cuda.set_sync_debug_mode("error") around forward + backward);
#   2. the Mixtral-8x7B shape with as many of its 32 layers as fit one H200 (4: scripts/plan.py plans
#      128.4 of 141 GiB at ZeRO-1; 3 if 4 runs out of memory), EP=1, bf16 and FP8 (Transformer Engine
#      for attention and the dense linears; the experts' grouped GEMMs stay bf16), tokens/s, MFU by
#      hybridlm.training.metrics.flops_per_token, peak memory;
#   3. a fine-grained shape on the same GPU (64 experts of width 1792, top-8: Mixtral's expert parameters,
#      half its active expert FLOPs);
#   4. one profiled bf16 run (--profile-step-range) for PROFILES.md: GPU time by kind of kernel
#      (grouped GEMM = experts, other GEMMs, attention, sort/gather = permutation) and host-idle sites
#      (hybridlm.moe.split_sizes is the EP>1 sync; with EP=1 there should be none in the layer).
# Usage (device tool, from the repository root; each run builds a 4-layer 5.8B model, so split it over
# calls to stay within 10 minutes):  ONLY=tests,bf16,fp8 bash benchmarks/device_moe.sh
#                                   ONLY=finegrained_bf16,profiled_bf16 bash benchmarks/device_moe.sh
set -uo pipefail
source .device/install.sh || exit 1
export PYTHONPATH=$PWD:${PYTHONPATH:-} OMP_NUM_THREADS=8
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT/logs"
want() { [[ -z "${ONLY:-}" || ",$ONLY," == *",$1,"* ]]; }
if want tests; then
  timeout 180 python3 -m pytest tests/test_moe.py -m gpu -q -p no:cacheprovider > "$OUT/logs/moe_tests.log" 2>&1
  echo "[gpu tests] $(tail -1 "$OUT/logs/moe_tests.log")"; grep -h -E '^(E  |FAILED)' "$OUT/logs/moe_tests.log" | head -6
fi

COMMON=(--model mixtral-8x7b --steps 10 --warmup 4)
SHAPE=(--global-batch-size 8 --bf16 --deepspeed_config ds_configs/zero1.json)
FP8=(--transformer-impl transformer_engine --fp8-format hybrid)
run() {  # name layers timeout extra...
  local name=$1 layers=$2 limit=$3; shift 3
  want "$name" || return 0
  timeout "$limit" deepspeed --num_gpus 1 scripts/benchmark.py "${COMMON[@]}" --label "EP=1, Mixtral-8x7B shape, $layers of 32 layers, gbs 8, ZeRO-1, $name" \
      --results-file "$OUT/rows_$name.md" -- --num-layers "$layers" "${SHAPE[@]}" "$@" > "$OUT/logs/$name.log" 2>&1
  local rc=$?
  echo "[$name L$layers] rc=$rc $(grep -h '^BENCH' "$OUT/logs/$name.log")"
  [ $rc -ne 0 ] && grep -h -E 'Error|error:|out of memory' "$OUT/logs/$name.log" | tail -3
  grep -h -A40 '^profile of steps' "$OUT/logs/$name.log" | grep -v -E '^(iter|\[)' | head -40
  return $rc
}
layers=${LAYERS:-4}
run bf16 "$layers" 280 || { [ "$layers" = 4 ] && layers=3 && run bf16 "$layers" 280; }
run fp8 "$layers" 280 "${FP8[@]}"
run finegrained_bf16 "$layers" 280 --num-experts 64 --moe-router-topk 8 --moe-ffn-hidden-size 1792
run profiled_bf16 "$layers" 280 --profile-step-range 6,8 --profile-dir "$OUT/profile"
cat "$OUT"/rows_*.md 2>/dev/null
