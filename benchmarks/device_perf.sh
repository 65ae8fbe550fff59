#!/usr/bin/env bash
# Issue 9/6 measurements on one host with 4 GPUs, four independent single-GPU lanes at once
# (one GPU each, so they do not share a device), then the 4-GPU runs. From the repo root,
# with .device staged (`../shared/device/stage.sh ds te`):  bash benchmarks/device_perf.sh [lanes|multi|all]
# Rows for benchmarks/RESULTS.md land in $OUT/rows.md; logs in $OUT/logs.tar.gz.
set -uo pipefail
source .device/install.sh || exit 1
export HYBRIDLM_DEVICE_READY=1  # lanes below must not re-install into /tmp/site while others import from it
export PYTHONPATH=$PWD:${PYTHONPATH:-} OMP_NUM_THREADS=8
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT/logs" "$OUT/prof"
what=${1:-all}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | head -1
python3 -c "import torch, deepspeed; print('torch', torch.__version__, 'deepspeed', deepspeed.__version__, 'gpus', torch.cuda.device_count())"

REF=(--model reference --steps 20 --warmup 6)
GBS32=(--bf16 --global-batch-size 32 --deepspeed_config ds_configs/zero1.json)
source benchmarks/device_common.sh

lane0() {
  python3 benchmarks/attention.py --batch 4 --heads 16 --seq 4096 --head-dim 128 --results-file "$OUT/rows_attn.md" > "$OUT/logs/attn.log" 2>&1
  echo "[attention] rc=$?"; cat "$OUT/logs/attn.log" | tail -6
  CUDA_VISIBLE_DEVICES=0 timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_attention.py > "$OUT/logs/test_attention.log" 2>&1
  echo "[test_attention] rc=$? $(tail -1 "$OUT/logs/test_attention.log")"
  bench ref_eager 0 29510 240 "${REF[@]}" --label "1 GPU, ZeRO-1, bf16, gbs 32, auto attention" -- "${GBS32[@]}" \
      --profile-step-range 22,24 --profile-dir "$OUT/prof/eager"
}
lane1() {
  bench ref_compile_baselines 1 29511 560 "${REF[@]}" --baselines torch,torch-compile,hf-zero2 \
      --label "1 GPU, ZeRO-1, bf16, gbs 32, --torch-compile" -- "${GBS32[@]}" --torch-compile \
      --profile-step-range 22,24 --profile-dir "$OUT/prof/compile"
}
lane2() {
  bench ref_te_bf16 2 29512 240 "${REF[@]}" --label "1 GPU, ZeRO-1, gbs 32, TE linears bf16" -- "${GBS32[@]}" --transformer-impl transformer_engine
  bench ref_te_fp8 2 29512 240 "${REF[@]}" --label "1 GPU, ZeRO-1, gbs 32, TE FP8 hybrid delayed" -- "${GBS32[@]}" \
      --transformer-impl transformer_engine --fp8-format hybrid --fp8-amax-history-len 1024 --fp8-amax-compute-algo max
}
lane3() {
  CUDA_VISIBLE_DEVICES=3 timeout 300 python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py -k "transformer_engine_linears_track or fp8" \
      > "$OUT/logs/test_gpu_te.log" 2>&1
  echo "[test_gpu TE/FP8] rc=$? $(tail -1 "$OUT/logs/test_gpu_te.log")"
  grep -h -E '^E  ' "$OUT/logs/test_gpu_te.log" | head -5
  bench ref_compile_gbs4 3 29513 240 "${REF[@]}" --label "1 GPU, ZeRO-1, bf16, gbs 4 (no accumulation), --torch-compile" -- \
      --bf16 --deepspeed_config ds_configs/zero1.json --torch-compile
}
multi() {
  bench ref_dp4 0,1,2,3 29520 240 "${REF[@]}" --label "DP=4 ZeRO-1, bf16, gbs 128, --torch-compile" -- \
      --bf16 --global-batch-size 128 --deepspeed_config ds_configs/zero1.json --torch-compile \
      --profile-step-range 22,24 --profile-dir "$OUT/prof/dp4"
}
# A 7B-class model (Llama 2 7B: hidden 4096, 32 layers, seq 4096, micro-batch 1), 4 GPUs.
B7=(--model llama2-7b --steps 8 --warmup 4)
seven_b() {
  python3 benchmarks/attention.py --batch 4 --heads 16 --seq 4096 --head-dim 128 --results-file "$OUT/rows_attn.md" > "$OUT/logs/attn.log" 2>&1
  echo "[attention] rc=$?"; tail -6 "$OUT/logs/attn.log"
  timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_attention.py > "$OUT/logs/test_attention.log" 2>&1
  echo "[test_attention] rc=$? $(tail -1 "$OUT/logs/test_attention.log")"; grep -h -E '^(E  |FAILED)' "$OUT/logs/test_attention.log" | head -8
  bench 7b_tp2_dp2 0,1,2,3 29530 200 "${B7[@]}" --label "TP=2 SP x DP=2, ZeRO-1, bf16, gbs 16, --torch-compile" -- \
      --bf16 --tensor-model-parallel-size 2 --sequence-parallel --global-batch-size 16 --deepspeed_config ds_configs/zero1.json \
      --torch-compile --profile-step-range 10,11 --profile-dir "$OUT/prof/7b_tp2"
  bench 7b_pp2_dp2 0,1,2,3 29531 200 "${B7[@]}" --label "PP=2 x DP=2, ZeRO-1, bf16, gbs 16, --torch-compile" -- \
      --bf16 --pipeline-model-parallel-size 2 --global-batch-size 16 --deepspeed_config ds_configs/zero1.json \
      --torch-compile --profile-step-range 10,11 --profile-dir "$OUT/prof/7b_pp2"
  bench 7b_zero3_dp4 0,1,2,3 29532 200 "${B7[@]}" --label "ZeRO-3 DP=4, bf16, gbs 16" -- \
      --bf16 --global-batch-size 16 --deepspeed_config ds_configs/zero3.json \
      --profile-step-range 10,11 --profile-dir "$OUT/prof/7b_zero3"
}

if [ "$what" = lanes ] || [ "$what" = all ]; then
  ( lane0 > "$OUT/lane0.txt" 2>&1 ) & ( lane1 > "$OUT/lane1.txt" 2>&1 ) &
  ( lane2 > "$OUT/lane2.txt" 2>&1 ) & ( lane3 > "$OUT/lane3.txt" 2>&1 ) &
  wait
  cat "$OUT"/lane*.txt
fi
if [ "$what" = multi ] || [ "$what" = all ]; then
  multi
fi
# Second round: TP without the RNG fork's graph breaks, ZeRO-3 with more work per gather,
# ZeRO-3 + CPU offload of a 7B model on one GPU.
seven_b_more() {
  bench 7b_tp2_dp2 0,1,2,3 29540 300 "${B7[@]}" --label "TP=2 SP x DP=2, ZeRO-1, bf16, gbs 16, --torch-compile" -- \
      --bf16 --tensor-model-parallel-size 2 --sequence-parallel --global-batch-size 16 --deepspeed_config ds_configs/zero1.json \
      --torch-compile --fused-ops none --profile-step-range 10,11 --profile-dir "$OUT/prof/7b_tp2"
  bench 7b_zero3_dp4_mb2 0,1,2,3 29541 200 "${B7[@]}" --label "ZeRO-3 DP=4, bf16, mb 2, gbs 32" -- \
      --bf16 --micro-batch-size 2 --global-batch-size 32 --deepspeed_config ds_configs/zero3.json \
      --profile-step-range 10,11 --profile-dir "$OUT/prof/7b_zero3_mb2"
}
offload_7b() {  # one GPU
  bench 7b_offload 0 29542 300 --model llama2-7b --steps 3 --warmup 1 --label "1 GPU, ZeRO-3 + CPU offload (params and optimizer), bf16, gbs 1" -- \
      --bf16 --global-batch-size 1 --deepspeed_config ds_configs/zero3_offload_cpu.json
}
# Final round: the reference with --torch-compile now that auto keeps fused custom ops out of
# the compiled graphs, side by side with the baselines, and two batch/ZeRO variants.
round5() {
  ( bench ref_compile_vs 0 29550 330 "${REF[@]}" --baselines torch-compile,hf-zero2 \
      --label "1 GPU, ZeRO-1, bf16, gbs 32, --torch-compile" -- "${GBS32[@]}" --torch-compile \
      --profile-step-range 22,24 --profile-dir "$OUT/prof/ref_compile" > "$OUT/lane_r0.txt" 2>&1 ) &
  ( bench ref_compile_gbs64 1 29551 240 "${REF[@]}" --label "1 GPU, ZeRO-1, bf16, gbs 64, --torch-compile" -- \
      --bf16 --global-batch-size 64 --deepspeed_config ds_configs/zero1.json --torch-compile > "$OUT/lane_r1.txt" 2>&1 ) &
  ( bench ref_compile_zero0 2 29552 240 "${REF[@]}" --label "1 GPU, ZeRO-0, bf16, gbs 32, --torch-compile" -- \
      --bf16 --global-batch-size 32 --deepspeed_config ds_configs/zero0.json --torch-compile > "$OUT/lane_r2.txt" 2>&1 ) &
  ( bench ref_fp8_current 3 29553 240 "${REF[@]}" --label "1 GPU, ZeRO-1, gbs 32, TE FP8 e4m3 current scaling" -- "${GBS32[@]}" \
      --transformer-impl transformer_engine --fp8-format e4m3 --fp8-recipe current > "$OUT/lane_r3.txt" 2>&1 ) &
  wait
  cat "$OUT"/lane_r*.txt
}
if [ "$what" = round5 ]; then
  round5
fi
if [ "$what" = 7b ]; then
  seven_b
fi
if [ "$what" = round3 ]; then
  seven_b_more
fi
if [ "$what" = round4 ]; then
  ( offload_7b > "$OUT/lane_offload.txt" 2>&1 ) &
  ( CUDA_VISIBLE_DEVICES=1 OUT="$OUT/ops" bash benchmarks/device_ops.sh > "$OUT/lane_ops.txt" 2>&1 ) &
  ( CUDA_VISIBLE_DEVICES=2,3 timeout 400 python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py \
      -k "transformer_engine_linears_under_tp2 or (tp2_sp and bf16)" > "$OUT/logs/test_gpu_tp.log" 2>&1
    echo "[test_gpu TP] rc=$? $(tail -1 "$OUT/logs/test_gpu_tp.log")"; grep -h -E '^E  ' "$OUT/logs/test_gpu_tp.log" | head -5
    [ -x benchmarks/device_plan.sh ] && CUDA_VISIBLE_DEVICES=2,3 OUT="$OUT/plan" bash benchmarks/device_plan.sh ) > "$OUT/lane_tests.txt" 2>&1 &
  wait
  cat "$OUT"/lane_*.txt
  cat "$OUT"/ops/rows.md "$OUT"/plan/rows.md >> "$OUT/rows_lanes.md" 2>/dev/null
  mv "$OUT"/ops/logs.tar.gz "$OUT/logs/ops_logs.tar.gz" 2>/dev/null; mv "$OUT"/plan/logs.tar.gz "$OUT/logs/plan_logs.tar.gz" 2>/dev/null
fi
# keep the profile summaries, drop the (large) traces
find "$OUT/prof" -name 'trace_rank*.json' -delete 2>/dev/null
cat "$OUT"/rows_*.md > "$OUT/rows.md" 2>/dev/null
tar -czf "$OUT/logs.tar.gz" -C "$OUT" logs prof && rm -rf "$OUT/logs" "$OUT/prof" "$OUT"/rows_*.md
echo "--- rows"; cat "$OUT/rows.md"
