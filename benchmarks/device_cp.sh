#!/usr/bin/env bash
# Context parallelism (issue 19) on the lent GPU machine. From the repo root, .device staged with
# `../shared/device/stage.sh ds` (add `fa` in an earlier call for flash-attn-4, see device/README.md):
#   kernels   (one GPU) the log-sum-exp block kernels (torch flash, cuDNN, flash-attn) against the plain
#             definition, and the ring simulated over 2 and 4 ranks in one process, against full attention
#   track     (two GPUs) CP=2 tracks one GPU over 20 bf16 steps, p2p and a2a (the same global batch)
#   speed     (two GPUs) the 944M reference at 256K tokens per sample with CP=2, p2p then a2a, one at a
#             time; MFU as scripts/benchmark.py reports it; then CP=1 at 128K on one GPU for the per-GPU figure
#   longest   (two GPUs) the longest sequence that trains, CP=1 on one GPU and CP=2 on two (p2p)
# Rows land in $OUT/rows_*.md, logs in $OUT/logs.
set -uo pipefail
source .device/install.sh || exit 1
export PYTHONPATH=$PWD:${PYTHONPATH:-} OMP_NUM_THREADS=8
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT/logs"
what=${1:?a mode: kernels, track, speed or longest}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
source benchmarks/device_common.sh

cp_tests() {  # name timeout -k expression
  timeout "$2" python3 -m pytest -q -p no:cacheprovider -rA tests/test_context_parallel_gpu.py -k "$3" > "$OUT/logs/$1.log" 2>&1
  echo "[$1] rc=$? $(tail -1 "$OUT/logs/$1.log")"
  grep -h -E '^(E  |FAILED|SKIPPED)' "$OUT/logs/$1.log" | head -12
}

LONG=(--bf16 --deepspeed_config ds_configs/zero1.json --micro-batch-size 1 --global-batch-size 1 --recompute-granularity full)

case "$what" in
  kernels) cp_tests kernels 500 "block_kernel or simulated" ;;
  track) cp_tests track 500 "two_gpus" ;;
  speed)
    for comm in p2p a2a; do
      bench "ref256k_cp2_$comm" 0,1 29710 300 --model reference --steps 4 --warmup 2 \
          --label "2 GPUs, CP=2 $comm, seq 262144, mb 1, full recompute, ZeRO-1, bf16" -- \
          "${LONG[@]}" --seq-length 262144 --context-parallel-size 2 --cp-comm-type "$comm" \
          --profile-step-range 4,5 --profile-dir "$OUT/prof/cp2_$comm"
    done
    bench ref128k_cp1 0 29711 300 --model reference --steps 4 --warmup 2 \
        --label "1 GPU, seq 131072, mb 1, full recompute, ZeRO-1, bf16" -- "${LONG[@]}" --seq-length 131072 ;;
  longest)
    for seq in 131072 196608 262144; do
      bench "cp1_$seq" 0 29712 300 --model reference --steps 2 --warmup 1 --label "1 GPU, seq $seq" -- "${LONG[@]}" --seq-length "$seq"
    done
    for seq in 262144 393216 524288; do
      bench "cp2_$seq" 0,1 29713 300 --model reference --steps 2 --warmup 1 --label "2 GPUs CP=2 p2p, seq $seq" -- \
          "${LONG[@]}" --seq-length "$seq" --context-parallel-size 2
    done ;;
  *) echo "unknown mode $what"; exit 2 ;;
esac
