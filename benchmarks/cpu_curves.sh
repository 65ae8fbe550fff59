#!/usr/bin/env bash
# Issue 10 rehearsed on CPU (8 gloo ranks on one machine): 200 steps of the built-in tiny model (dense) or
# its Mixtral-style variant (moe), once on 1 rank and once on 8, compared by scripts/compare_runs.py.
#   dense  TP=2 SP x PP=2 x DP=2, ZeRO-1      moe  EP=4 x DP=8, ZeRO-1
# fp32, same seed, data and global batch. Usage: bash benchmarks/cpu_curves.sh dense|moe [RESULTS_FILE]
set -euo pipefail
what=${1:?dense or moe}; results=${2:-}
out=${OUT:-/tmp/hybridlm-curves}; mkdir -p "$out"
export DS_ACCELERATOR=cpu OMP_NUM_THREADS=1
common=(scripts/pretrain.py --deepspeed_config ds_configs/zero1.json --train-iters 200 --log-interval 1
        --global-batch-size 16 --micro-batch-size 2 --seed 1234)
case "$what" in
  dense) model=(); layout=(--tensor-model-parallel-size 2 --sequence-parallel --pipeline-model-parallel-size 2)
         shape="built-in tiny (d128 L4, byte vocab 257), seq 128"; label="TP=2 SP x PP=2 x DP=2, ZeRO-1, fp32, gbs 16"
         tolerance=0.01 ;;
  moe)   model=(--num-experts 8 --moe-router-topk 2 --moe-aux-loss-coeff 0.02); layout=(--expert-model-parallel-size 4)
         shape="built-in tiny (d128 L4) with 8 experts top-2 in every layer, seq 128"; label="EP=4 x DP=8, ZeRO-1, fp32, gbs 16"
         tolerance=0.02 ;;  # a rounding difference that flips one token's top-2 choice makes the curves part by ~1%
  *) echo "unknown mode $what (dense or moe)" >&2; exit 2 ;;
esac
deepspeed --num_gpus 1 "${common[@]}" "${model[@]}" --metrics-file "$out/${what}_1.jsonl" > "$out/${what}_1.log" 2>&1
deepspeed --num_gpus 8 "${common[@]}" "${model[@]}" "${layout[@]}" --metrics-file "$out/${what}_8.jsonl" > "$out/${what}_8.log" 2>&1
python scripts/compare_runs.py "$out/${what}_1.jsonl" "$out/${what}_8.jsonl" --window 10 --tolerance "$tolerance" \
    ${results:+--results-file "$results"} --device "CPU (2 cores), 8 gloo ranks" --model "$shape" --layout "$label, 200 steps vs 1 rank"
