# Sourced by the benchmarks/device_*.sh scripts that run several GPU jobs side by side:
# each job's log under $OUT/logs, its results-table rows in $OUT/rows_<name>.md, one summary line.

bench() {  # name gpus(include list) port timeout args...
  local name=$1 gpus=$2 port=$3 limit=$4; shift 4
  timeout "$limit" deepspeed --include "localhost:$gpus" --master_port "$port" scripts/benchmark.py \
      --results-file "$OUT/rows_$name.md" "$@" > "$OUT/logs/$name.log" 2>&1
  local rc=$?
  echo "[$name] rc=$rc $(grep -h -E '^(BENCH|BASELINE)' "$OUT/logs/$name.log" | tr '\n' ' ')"
  [ $rc -ne 0 ] && grep -h -E 'Error|error:|out of memory' "$OUT/logs/$name.log" | tail -3
  grep -h -A40 '^profile of steps' "$OUT/logs/$name.log" | grep -v -E '^(iter|\[)' | head -40
}

gpu_tests() {  # name gpus timeout -k expression
  local name=$1 gpus=$2 limit=$3 expr=$4
  CUDA_VISIBLE_DEVICES=$gpus timeout "$limit" python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py -k "$expr" \
      > "$OUT/logs/$name.log" 2>&1
  echo "[$name] rc=$? $(tail -1 "$OUT/logs/$name.log")"
  grep -h -E '^(E  |FAILED)' "$OUT/logs/$name.log" | head -6
}
