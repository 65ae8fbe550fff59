#!/usr/bin/env bash
# Issue 9/6 re-measurements on a 4-GPU H200 host after --torch-compile learned TP and
# Transformer Engine (collectives and TE GEMMs outside the graphs) and flash-attn-4 arrived.
#   attention  (.device staged with `stage.sh fa` alone) install flash-attn-4, time the attention backends
#   lanes      (.device with `stage.sh ds te`, same warm machine) four 1-GPU lanes: the reference with
#              flash-attn-4 beside the baselines, batch/ZeRO variants, TE FP8 + compile, the largest
#              models with and without CPU offload
#   multi      2-GPU correctness tests in two pairs, then the 7B shape at TP=2 SP x DP=2 compiled
#   final      the fixes after multi (see below); sizes, te_fused_x2, te_fused_compile: later rounds
# From the repo root:  bash benchmarks/device_targets.sh MODE   (rows land in $OUT/rows.md)
set -uo pipefail
source .device/install.sh || exit 1
export HYBRIDLM_DEVICE_READY=1 PYTHONPATH=$PWD:${PYTHONPATH:-} OMP_NUM_THREADS=8
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT/logs" "$OUT/prof"
what=${1:?a mode: attention, lanes, multi, final, sizes, te_fused_x2 or te_fused_compile}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | head -1

REF=(--model reference --steps 20 --warmup 6)
source benchmarks/device_common.sh

nooffload() {  # gpu port layers...: the 7B shape cut to fewer layers, no offload, seq 2048, mb 1
  local gpu=$1 port=$2; shift 2
  for layers in "$@"; do
    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True bench nooffload_L$layers "$gpu" "$port" 160 --model llama2-7b --steps 3 --warmup 1 \
        --label "1 GPU, no offload, ZeRO-2, full recompute, seq 2048, mb 1, $layers layers" -- \
        --num-layers $layers --seq-length 2048 --bf16 --micro-batch-size 1 --global-batch-size 1 \
        --recompute-granularity full --deepspeed_config ds_configs/zero2.json
  done
}

if [ "$what" = attention ]; then
  python3 -c "import flash_attn.cute; print('flash-attn-4 imports')" || exit 1
  python3 benchmarks/attention.py --batch 4 --heads 16 --seq 4096 --head-dim 128 --results-file "$OUT/rows_attn.md"
fi

lane0() {  # the headline: hybridlm with flash-attn-4 (auto) beside the baselines, same process
  CUDA_VISIBLE_DEVICES=0 timeout 240 python3 -m pytest -q -p no:cacheprovider tests/test_attention.py > "$OUT/logs/test_attention.log" 2>&1
  echo "[test_attention] rc=$? $(tail -1 "$OUT/logs/test_attention.log")"; grep -h -E '^(E  |FAILED)' "$OUT/logs/test_attention.log" | head -6
  bench ref_flash_vs 0 29560 420 "${REF[@]}" --baselines torch-compile,hf-zero2 \
      --label "1 GPU, ZeRO-1, bf16, gbs 64, --torch-compile, flash-attn-4 (auto)" -- \
      --bf16 --global-batch-size 64 --deepspeed_config ds_configs/zero1.json --torch-compile
}
lane1() {  # batch / ZeRO variants, then the largest model without offload (seq 2048, full recompute)
  bench ref_flash_zero0_gbs64 1 29561 200 "${REF[@]}" --label "1 GPU, ZeRO-0, bf16, gbs 64, --torch-compile, flash-attn-4" -- \
      --bf16 --global-batch-size 64 --deepspeed_config ds_configs/zero0.json --torch-compile
  bench ref_flash_zero0_gbs128 1 29561 220 --model reference --steps 10 --warmup 4 --label "1 GPU, ZeRO-0, bf16, gbs 128, --torch-compile, flash-attn-4" -- \
      --bf16 --global-batch-size 128 --deepspeed_config ds_configs/zero0.json --torch-compile
  for layers in 35 37; do
    bench nooffload_L$layers 1 29561 150 --model llama2-7b --steps 3 --warmup 1 \
        --label "1 GPU, no offload, ZeRO-2, full recompute, seq 2048, mb 1, $layers layers" -- \
        --num-layers $layers --seq-length 2048 --bf16 --micro-batch-size 1 --global-batch-size 1 \
        --recompute-granularity full --deepspeed_config ds_configs/zero2.json
  done
}
lane2() {  # Transformer Engine with compiled layers: FP8 (both recipes) and bf16
  bench ref_te_fp8_compile 2 29562 200 "${REF[@]}" --label "1 GPU, ZeRO-1, gbs 64, TE FP8 hybrid delayed, --torch-compile, flash-attn-4" -- \
      --bf16 --global-batch-size 64 --deepspeed_config ds_configs/zero1.json --torch-compile \
      --transformer-impl transformer_engine --fp8-format hybrid --fp8-amax-history-len 1024 --fp8-amax-compute-algo max
  bench ref_te_fp8_current_compile 2 29562 200 "${REF[@]}" --label "1 GPU, ZeRO-1, gbs 64, TE FP8 e4m3 current, --torch-compile, flash-attn-4" -- \
      --bf16 --global-batch-size 64 --deepspeed_config ds_configs/zero1.json --torch-compile \
      --transformer-impl transformer_engine --fp8-format e4m3 --fp8-recipe current
  bench ref_te_bf16_compile 2 29562 200 "${REF[@]}" --label "1 GPU, ZeRO-1, gbs 64, TE linears bf16, --torch-compile, flash-attn-4" -- \
      --bf16 --global-batch-size 64 --deepspeed_config ds_configs/zero1.json --torch-compile --transformer-impl transformer_engine
}
lane3() {  # the largest model with CPU offload (ZeRO-3, parameters and optimizer on the host)
  free -g | head -2
  bench offload_13b 3 29563 560 --model llama2-13b --steps 2 --warmup 1 \
      --label "1 GPU, ZeRO-3 + CPU offload (params and optimizer), full recompute, seq 2048, mb 1" -- \
      --seq-length 2048 --bf16 --micro-batch-size 1 --global-batch-size 1 --recompute-granularity full \
      --deepspeed_config ds_configs/zero3_offload_cpu.json
}
if [ "$what" = lanes ]; then
  ( lane0 > "$OUT/lane0.txt" 2>&1 ) & ( lane1 > "$OUT/lane1.txt" 2>&1 ) &
  ( lane2 > "$OUT/lane2.txt" 2>&1 ) & ( lane3 > "$OUT/lane3.txt" 2>&1 ) &
  wait
  cat "$OUT"/lane*.txt
fi

if [ "$what" = multi ]; then
  ( gpu_tests test_gpu_compile 0,1 300 "torch_compile_on_two_gpus" > "$OUT/pair0.txt" 2>&1 ) &
  ( gpu_tests test_gpu_te 2,3 300 "transformer_engine or fp8" > "$OUT/pair1.txt" 2>&1 ) &
  wait
  cat "$OUT"/pair*.txt
  bench 7b_tp2_dp2_compile 0,1,2,3 29570 280 --model llama2-7b --steps 8 --warmup 4 \
      --label "TP=2 SP x DP=2, ZeRO-1, bf16, gbs 16, --torch-compile (collectives outside the graphs)" -- \
      --bf16 --tensor-model-parallel-size 2 --sequence-parallel --global-batch-size 16 \
      --deepspeed_config ds_configs/zero1.json --torch-compile --profile-step-range 10,11 --profile-dir "$OUT/prof/7b_tp2"
fi

# After the first three: fp32 compiled tests with flash-attn's SDPA fallback, FP8 + compile tests, the
# largest model without offload at 32/33 layers, and the 7B TP=2 at micro-batch 2 (half the per-step
# host work of the graph breaks per token).
if [ "$what" = final ]; then
  ( gpu_tests test_gpu_compile 0,1 330 "torch_compile_on_two_gpus" > "$OUT/pair0.txt" 2>&1 ) &
  ( gpu_tests test_gpu_fp8 2 330 "fp8" > "$OUT/pair1.txt" 2>&1 ) &
  ( nooffload 3 29563 32 33 > "$OUT/lane3.txt" 2>&1 ) &
  wait
  cat "$OUT"/pair*.txt "$OUT/lane3.txt"
  bench 7b_tp2_dp2_mb2_compile 0,1,2,3 29571 280 --model llama2-7b --steps 6 --warmup 3 \
      --label "TP=2 SP x DP=2, ZeRO-1, bf16, mb 2, gbs 16, --torch-compile (collectives outside the graphs)" -- \
      --bf16 --tensor-model-parallel-size 2 --sequence-parallel --micro-batch-size 2 --global-batch-size 16 \
      --deepspeed_config ds_configs/zero1.json --torch-compile --profile-step-range 8,9 --profile-dir "$OUT/prof/7b_tp2_mb2"
fi

# Model size bounds on one H200: without offload (7B at 32 layers did not fit: DeepSpeed's fp32
# gradient buffer on top of 113 GiB), and a ~19B shape with CPU offload (13B trained).
if [ "$what" = sizes ]; then
  ( nooffload 0 29580 28 30 > "$OUT/lane0.txt" 2>&1 ) &
  ( bench offload_19b 1 29581 500 --model llama2-13b --steps 2 --warmup 1 \
      --label "1 GPU, ZeRO-3 + CPU offload (params and optimizer), full recompute, seq 2048, mb 1, 60 layers" -- \
      --num-layers 60 --seq-length 2048 --bf16 --micro-batch-size 1 --global-batch-size 1 --recompute-granularity full \
      --deepspeed_config ds_configs/zero3_offload_cpu.json > "$OUT/lane1.txt" 2>&1; free -g | head -2 >> "$OUT/lane1.txt" ) &
  wait
  cat "$OUT"/lane*.txt
fi

# Transformer Engine's LayerNormLinear fusion (norm into the QKV / fc1 GEMMs) on a 2-GPU host: the TE
# tests that exercise it, and the reference model with TE FP8 (eager).
if [ "$what" = te_fused_x2 ]; then
  gpu_tests test_gpu_te_tp2 0,1 200 "transformer_engine_linears_under_tp2 and no_sp"
  ( gpu_tests test_gpu_te_local 0 200 "transformer_engine_linears_track and eager" > "$OUT/pair0.txt" 2>&1 ) &
  ( bench ref_te_fp8_fused 1 29590 200 "${REF[@]}" --label "1 GPU, ZeRO-1, gbs 32, TE FP8 hybrid delayed, norms fused (LayerNormLinear)" -- \
        --bf16 --global-batch-size 32 --deepspeed_config ds_configs/zero1.json --transformer-impl transformer_engine --fp8-format hybrid --fp8-amax-history-len 1024 --fp8-amax-compute-algo max \
        > "$OUT/lane1.txt" 2>&1 ) &
  wait
  cat "$OUT"/pair*.txt "$OUT"/lane1.txt
fi

# TE FP8 with fused norms, compiled and eager, side by side on a 2-GPU host; then the compiled TE test.
if [ "$what" = te_fused_compile ]; then
  FP8=(--bf16 --global-batch-size 64 --deepspeed_config ds_configs/zero1.json --transformer-impl transformer_engine --fp8-format hybrid --fp8-amax-history-len 1024 --fp8-amax-compute-algo max)
  ( bench ref_te_fp8_fused_compile 0 29600 200 "${REF[@]}" --label "1 GPU, ZeRO-1, gbs 64, TE FP8 hybrid delayed, norms fused, --torch-compile" -- \
        "${FP8[@]}" --torch-compile > "$OUT/lane0.txt" 2>&1 ) &
  ( bench ref_te_fp8_fused_gbs64 1 29601 200 "${REF[@]}" --label "1 GPU, ZeRO-1, gbs 64, TE FP8 hybrid delayed, norms fused" -- \
        "${FP8[@]}" > "$OUT/lane1.txt" 2>&1 ) &
  wait
  cat "$OUT"/lane*.txt
  gpu_tests test_gpu_te_compiled 0 150 "transformer_engine_linears_track and compiled"
fi

find "$OUT/prof" -name 'trace_rank*.json' -delete 2>/dev/null
cat "$OUT"/rows_*.md > "$OUT/rows.md" 2>/dev/null
tar -czf "$OUT/logs.tar.gz" -C "$OUT" logs prof && rm -rf "$OUT/logs" "$OUT/prof" "$OUT"/rows_*.md
echo "--- rows"; cat "$OUT/rows.md" 2>/dev/null
