#!/usr/bin/env bash
# Issue 9's FP8 target (TE FP8 >= 125k tok/s on the reference model, one H200): after the whole-MLP
# fusion (TE LayerNormMLP) and the FP8 weight cache across micro-batches.
#   fa      (.device staged with `stage.sh fa` alone) install flash-attn-4 into /tmp/site
#   round1  (.device with `stage.sh ds te`, the same warm 2-GPU machine) GPU 0: the reference in FP8,
#           compiled, with cuDNN attention (as the 102,264 row) and with flash-attn-4, profiled;
#           GPU 1: the TE and attention tests; then the 2-GPU TE test (fused block under TP=2)
#   round2  (one GPU, `stage.sh ds te`, cuDNN attention) one run at a time, nothing beside it (round1's
#           lanes disturbed each other: the FP8 run is host-bound): FP8 autocast once per forward, then
#           with --manual-gc, then micro-batch 8; the compiled FP8 test and the TE adapter tests after
#   round3  (one GPU, `stage.sh ds te`) batches copied from pinned memory (no host sync per micro-batch):
#           FP8 at ZeRO-1 and ZeRO-0 (profiled), bf16 compiled at ZeRO-0; the data-copy and TE tests
#   final   (one GPU, `stage.sh ds te`) FP8 at micro-batch 8 with all of the above; the eager FP8 tests
#   pieces  (one GPU, `stage.sh ds te`) with TE a layer compiles only what lies between the GEMMs:
#           FP8 at micro-batch 4 and 8, and the compiled TE tests
#   graphs  (one GPU, `stage.sh ds te`; ran 2026-11-23, before FP8 with --cuda-graphs was refused) the
#           CUDA-graph tests, then FP8 with each layer captured as CUDA graphs at micro-batch 4, profiled
#   graphs_final (the same; after cuDNN attention was kept out of small captured layers) the CUDA-graph
#           and attention tests, then FP8 with --cuda-graphs at micro-batch 8
#   graphs_fp8 (one GPU, `stage.sh ds te`; after the fused MLP block joined capture's FP8 bookkeeping and
#           the FP8 refusal was lifted) the CUDA-graph tests, FP8 --cuda-graphs at micro-batch 4, the
#           end-to-end graph tests (local bf16, TE bf16 compiled, TE FP8 compiled)
#   graphs_more (the same machine) bf16 compiled without and with --cuda-graphs; FP8 --cuda-graphs at mb 8
#   graphs_gaps (one GPU) after layers compiled whole are called once before capture: the graph tests,
#           bf16 compiled with --cuda-graphs; FP8 --cuda-graphs mb 4 profiled with its longest idle gaps
#   graphs_idle (one GPU) FP8 --cuda-graphs mb 4 profiled, idle time summed by host site
#   nosync  (one GPU) after DeepSpeed's throughput timer stopped syncing the device every micro-batch:
#           FP8 mb 4 with and without --cuda-graphs, bf16 compiled, FP8 --cuda-graphs profiled
#   fa_fp8  (the warm machine `fa` just ran on, .device restaged with `stage.sh ds te`) FP8 mb 4 with
#           flash-attn-4, without and with --cuda-graphs; bf16 compiled with flash-attn-4
#   fa_fp8_long (as fa_fp8) the graphed FP8 flash-attn-4 run timed after 20 warm-up steps
#   checks  (one GPU) the graph/TE/profile/DeepSpeed-config tests, the end-to-end graph and fp16 tests,
#           FP8 mb 4 without graphs again, and with --manual-gc
#   fusion  (one GPU, `stage.sh ds te`) --gradient-accumulation-fusion: its GPU unit tests and the graph
#           tests, then FP8 mb 4 with --cuda-graphs (cuDNN attention) with the fusion and without, side by side
#   fusion_more (the same) the end-to-end fusion tests (TE bf16 ZeRO-1/ZeRO-0, FP8 compiled with graphs);
#           FP8 mb 4 fused without graphs; FP8 mb 4 fused with graphs, profiled
#   fusion_tp2 (two GPUs, `stage.sh ds te`) the TE-under-TP=2 end-to-end tests, the fused variant included
#   sidebyside (one GPU) bf16 compiled, cuDNN attention, beside the three baselines in one process (after
#           DeepSpeed's per-micro-batch sync went; the HF baseline keeps DeepSpeed's defaults, as its users run it)
#   fa_fusion (the warm machine `fa` just ran on, .device restaged with `stage.sh ds te`) FP8 mb 4 with
#           flash-attn-4, --cuda-graphs and the fusion, timed after 20 warm-up steps, and without the fusion
# From the repo root:  bash benchmarks/device_fp8.sh MODE   (rows land in $OUT/rows.md)
set -uo pipefail
source .device/install.sh || exit 1
export HYBRIDLM_DEVICE_READY=1 PYTHONPATH=$PWD:${PYTHONPATH:-} OMP_NUM_THREADS=8
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT/logs" "$OUT/prof"
what=${1:?a mode: fa, round1, round2, round3, final, pieces, graphs, graphs_final, graphs_fp8, graphs_more, graphs_gaps, graphs_idle, nosync, checks, fa_fp8, fa_fp8_long, fusion, fusion_more, fusion_tp2, sidebyside or fa_fusion}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | head -1
source benchmarks/device_common.sh

if [ "$what" = fa ]; then
  python3 -c "import flash_attn.cute; print('flash-attn-4 imports')"; exit $?
fi

REF=(--model reference --steps 20 --warmup 6)
FP8=(--bf16 --deepspeed_config ds_configs/zero1.json --transformer-impl transformer_engine --fp8-format hybrid --fp8-amax-history-len 1024 --fp8-amax-compute-algo max --torch-compile)
if [ "$what" = round1 ]; then
  python3 -c "import flash_attn.cute" 2>/dev/null && echo "flash-attn-4 present" || echo "NO flash-attn-4"
  ( bench fp8_cudnn 0 29610 220 "${REF[@]}" --label "1 GPU, ZeRO-1, gbs 64, TE FP8 hybrid delayed, --torch-compile, norms+MLP fused, FP8 weight cache, cuDNN attention" -- \
        "${FP8[@]}" --global-batch-size 64 --attention-backend cudnn --profile-step-range 12,13 --profile-dir "$OUT/prof/fp8_cudnn"
    bench fp8_flash 0 29610 220 "${REF[@]}" --label "1 GPU, ZeRO-1, gbs 64, TE FP8 hybrid delayed, --torch-compile, norms+MLP fused, FP8 weight cache, flash-attn-4" -- \
        "${FP8[@]}" --global-batch-size 64 --profile-step-range 12,13 --profile-dir "$OUT/prof/fp8_flash"
    bench fp8_flash_gbs128 0 29610 200 --model reference --steps 10 --warmup 4 --label "1 GPU, ZeRO-1, gbs 128, TE FP8 hybrid delayed, --torch-compile, norms+MLP fused, FP8 weight cache, flash-attn-4" -- \
        "${FP8[@]}" --global-batch-size 128 ) > "$OUT/lane0.txt" 2>&1 &
  ( CUDA_VISIBLE_DEVICES=1 timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_transformer_engine.py tests/test_attention.py \
        > "$OUT/logs/test_te_attention.log" 2>&1
    echo "[test_te_attention] rc=$? $(tail -1 "$OUT/logs/test_te_attention.log")"
    grep -h -E '^(E  |FAILED)' "$OUT/logs/test_te_attention.log" | head -8
    gpu_tests test_gpu_te 1 330 "transformer_engine_linears_track or fp8_training" ) > "$OUT/lane1.txt" 2>&1 &
  wait
  cat "$OUT"/lane*.txt
  gpu_tests test_gpu_te_tp2 0,1 150 "transformer_engine_linears_under_tp2 and no_sp"
fi

if [ "$what" = round2 ]; then
  SHORT=(--model reference --steps 14 --warmup 6)
  L="1 GPU, ZeRO-1, gbs 64, TE FP8 hybrid delayed, --torch-compile, norms+MLP fused, FP8 weight cache, one FP8 autocast per forward, cuDNN attention"
  bench fp8_once 0 29620 170 "${SHORT[@]}" --label "$L" -- "${FP8[@]}" --global-batch-size 64
  bench fp8_once_gc 0 29620 170 "${SHORT[@]}" --label "$L, --manual-gc" -- "${FP8[@]}" --global-batch-size 64 --manual-gc --manual-gc-interval 10
  bench fp8_once_mb8 0 29620 170 "${SHORT[@]}" --label "${L/gbs 64/mb 8, gbs 64}" -- "${FP8[@]}" --global-batch-size 64 --micro-batch-size 8
  CUDA_VISIBLE_DEVICES=0 timeout 60 python3 -m pytest -q -p no:cacheprovider tests/test_transformer_engine.py > "$OUT/logs/test_te.log" 2>&1
  echo "[test_te] rc=$? $(tail -1 "$OUT/logs/test_te.log")"; grep -h -E '^(E  |FAILED)' "$OUT/logs/test_te.log" | head -6
  gpu_tests test_gpu_fp8_compiled 0 150 "fp8_training and compiled"
fi

if [ "$what" = round3 ]; then
  SHORT=(--model reference --steps 14 --warmup 6)
  L="1 GPU, ZeRO-1, gbs 64, TE FP8 hybrid delayed, --torch-compile, norms+MLP fused, FP8 weight cache, one FP8 autocast per forward, pinned batches, cuDNN attention"
  bench fp8_pinned 0 29630 170 "${SHORT[@]}" --label "$L" -- "${FP8[@]}" --global-batch-size 64
  bench fp8_pinned_zero0 0 29630 170 "${SHORT[@]}" --label "${L/ZeRO-1/ZeRO-0}" -- "${FP8[@]/zero1/zero0}" --global-batch-size 64 \
      --profile-step-range 10,11 --profile-dir "$OUT/prof/fp8_pinned_zero0"
  bench bf16_pinned_zero0 0 29630 170 "${SHORT[@]}" --label "1 GPU, ZeRO-0, bf16, gbs 64, --torch-compile, pinned batches, cuDNN attention" -- \
      --bf16 --deepspeed_config ds_configs/zero0.json --torch-compile --global-batch-size 64
  CUDA_VISIBLE_DEVICES=0 timeout 90 python3 -m pytest -q -p no:cacheprovider tests/test_transformer_engine.py \
      tests/test_data_gpt_dataset.py -k "gpu or te_ or queued" > "$OUT/logs/test_te_data.log" 2>&1
  echo "[test_te_data] rc=$? $(tail -1 "$OUT/logs/test_te_data.log")"; grep -h -E '^(E  |FAILED)' "$OUT/logs/test_te_data.log" | head -6
fi

if [ "$what" = final ]; then
  bench fp8_pinned_mb8 0 29640 170 --model reference --steps 14 --warmup 6 \
      --label "1 GPU, ZeRO-1, mb 8, gbs 64, TE FP8 hybrid delayed, --torch-compile, norms+MLP fused, FP8 weight cache, one FP8 autocast per forward, pinned batches, cuDNN attention" -- \
      "${FP8[@]}" --global-batch-size 64 --micro-batch-size 8
  gpu_tests test_gpu_fp8_eager 0 200 "fp8_training and not compiled"
fi

if [ "$what" = pieces ]; then
  L="1 GPU, ZeRO-1, gbs 64, TE FP8 hybrid delayed, --torch-compile between the GEMMs only, norms+MLP fused, FP8 weight cache, one FP8 autocast per forward, pinned batches, cuDNN attention"
  bench fp8_pieces 0 29650 170 --model reference --steps 14 --warmup 6 --label "$L" -- "${FP8[@]}" --global-batch-size 64
  bench fp8_pieces_mb8 0 29650 170 --model reference --steps 14 --warmup 6 --label "${L/gbs 64/mb 8, gbs 64}" -- \
      "${FP8[@]}" --global-batch-size 64 --micro-batch-size 8
  gpu_tests test_gpu_te_compiled 0 240 "compiled and (transformer_engine or fp8)"
fi

L_GRAPHS="1 GPU, ZeRO-1, gbs 64, TE FP8 hybrid delayed, --torch-compile between the GEMMs, --cuda-graphs, norms+MLP fused, FP8 weight cache, pinned batches, cuDNN attention"
if [ "$what" = graphs ]; then
  CUDA_LAUNCH_BLOCKING=1 CUDA_VISIBLE_DEVICES=0 timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_cuda_graphs.py > "$OUT/logs/test_graphs.log" 2>&1
  echo "[test_graphs] rc=$? $(tail -1 "$OUT/logs/test_graphs.log")"; grep -h -E '^(E  |FAILED)' "$OUT/logs/test_graphs.log" | head -8
  gpu_tests test_gpu_graphs 0 220 "cuda_graphs"
  bench fp8_graphs 0 29660 170 --model reference --steps 14 --warmup 6 --label "$L_GRAPHS" -- "${FP8[@]}" --global-batch-size 64 \
      --cuda-graphs --profile-step-range 10,11 --profile-dir "$OUT/prof/fp8_graphs"
fi

if [ "$what" = graphs_final ]; then
  CUDA_VISIBLE_DEVICES=0 timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_cuda_graphs.py tests/test_attention.py > "$OUT/logs/test_graphs.log" 2>&1
  echo "[test_graphs] rc=$? $(tail -1 "$OUT/logs/test_graphs.log")"; grep -h -E '^(E  |FAILED)' "$OUT/logs/test_graphs.log" | head -8
  gpu_tests test_gpu_graphs 0 240 "cuda_graphs"
  bench fp8_graphs_mb8 0 29660 150 --model reference --steps 14 --warmup 6 --label "${L_GRAPHS/gbs 64/mb 8, gbs 64}" -- \
      "${FP8[@]}" --global-batch-size 64 --micro-batch-size 8 --cuda-graphs
fi

if [ "$what" = graphs_fp8 ]; then  # after the fused MLP block joined capture's FP8 bookkeeping
  CUDA_VISIBLE_DEVICES=0 timeout 150 python3 -m pytest -q -rxXs -p no:cacheprovider tests/test_cuda_graphs.py > "$OUT/logs/test_graphs.log" 2>&1
  echo "[test_graphs] rc=$? $(tail -1 "$OUT/logs/test_graphs.log")"; grep -h -E '^(E  |FAILED|XPASS|XFAIL)' "$OUT/logs/test_graphs.log" | head -12
  bench fp8_graphs_mb4 0 29680 170 --model reference --steps 20 --warmup 6 --label "$L_GRAPHS" -- "${FP8[@]}" --global-batch-size 64 --cuda-graphs
  gpu_tests test_gpu_graphs 0 300 "cuda_graphs"
fi

if [ "$what" = graphs_more ]; then  # bf16 with and without graphs, FP8 with graphs at micro-batch 8
  L="1 GPU, ZeRO-1, bf16, gbs 64, --torch-compile, pinned batches, cuDNN attention"
  bench bf16_layers 0 29690 170 --model reference --steps 20 --warmup 6 --label "$L" -- \
      --bf16 --deepspeed_config ds_configs/zero1.json --torch-compile --global-batch-size 64
  bench bf16_graphs 0 29690 170 --model reference --steps 20 --warmup 6 --label "${L/--torch-compile/--torch-compile, --cuda-graphs}" -- \
      --bf16 --deepspeed_config ds_configs/zero1.json --torch-compile --global-batch-size 64 --cuda-graphs
  bench fp8_graphs_mb8 0 29690 170 --model reference --steps 20 --warmup 6 --label "${L_GRAPHS/gbs 64/mb 8, gbs 64}" -- \
      "${FP8[@]}" --global-batch-size 64 --micro-batch-size 8 --cuda-graphs --profile-step-range 16,17 --profile-dir "$OUT/prof/fp8_graphs_mb8"
fi

if [ "$what" = graphs_gaps ]; then  # layers compiled whole, captured; where the FP8 mb 4 step still idles
  CUDA_VISIBLE_DEVICES=0 timeout 150 python3 -m pytest -q -rxXs -p no:cacheprovider tests/test_cuda_graphs.py > "$OUT/logs/test_graphs.log" 2>&1
  echo "[test_graphs] rc=$? $(tail -1 "$OUT/logs/test_graphs.log")"; grep -h -E '^(E  |FAILED)' "$OUT/logs/test_graphs.log" | head -12
  gpu_tests test_gpu_graphs_compiled 0 150 "cuda_graphs and local_bf16_compiled"
  bench bf16_graphs 0 29700 170 --model reference --steps 20 --warmup 6 --label "1 GPU, ZeRO-1, bf16, gbs 64, --torch-compile, --cuda-graphs, pinned batches, cuDNN attention" -- \
      --bf16 --deepspeed_config ds_configs/zero1.json --torch-compile --global-batch-size 64 --cuda-graphs
  bench fp8_graphs_mb4_prof 0 29700 170 --model reference --steps 20 --warmup 6 --label "$L_GRAPHS" -- "${FP8[@]}" --global-batch-size 64 \
      --cuda-graphs --profile-step-range 16,17 --profile-dir "$OUT/prof/fp8_graphs_mb4"
fi

if [ "$what" = graphs_idle ]; then  # where FP8 --cuda-graphs mb 4 idles, summed by host site
  bench fp8_graphs_mb4_idle 0 29710 280 --model reference --steps 20 --warmup 6 --label "$L_GRAPHS" -- "${FP8[@]}" --global-batch-size 64 \
      --cuda-graphs --profile-step-range 16,17 --profile-dir "$OUT/prof/fp8_graphs_mb4"
fi

if [ "$what" = nosync ]; then  # after DeepSpeed's throughput timer stopped syncing at every micro-batch
  bench fp8_graphs_mb4_nosync 0 29720 200 --model reference --steps 20 --warmup 6 --label "$L_GRAPHS, no per-micro-batch sync" -- \
      "${FP8[@]}" --global-batch-size 64 --cuda-graphs
  bench fp8_mb4_nosync 0 29720 200 --model reference --steps 20 --warmup 6 --label "${L_GRAPHS/, --cuda-graphs/}, no per-micro-batch sync" -- \
      "${FP8[@]}" --global-batch-size 64
  L="1 GPU, ZeRO-1, bf16, gbs 64, --torch-compile, pinned batches, cuDNN attention, no per-micro-batch sync"
  bench bf16_nosync 0 29720 200 --model reference --steps 20 --warmup 6 --label "$L" -- \
      --bf16 --deepspeed_config ds_configs/zero1.json --torch-compile --global-batch-size 64
  bench fp8_graphs_mb4_nosync_prof 0 29720 200 --model reference --steps 14 --warmup 6 --label "$L_GRAPHS, no per-micro-batch sync" -- \
      "${FP8[@]}" --global-batch-size 64 --cuda-graphs --profile-step-range 10,11 --profile-dir "$OUT/prof/fp8_graphs_mb4"
fi

if [ "$what" = fa_fp8 ]; then  # the call after `fa` on the same warm machine, .device restaged with ds te
  python3 -c "import flash_attn.cute" 2>/dev/null && echo "flash-attn-4 present" || { echo "NO flash-attn-4"; exit 1; }
  LF="${L_GRAPHS/, --cuda-graphs/}, no per-micro-batch sync"
  bench fp8_flash_mb4 0 29740 170 --model reference --steps 20 --warmup 6 --label "${LF/cuDNN attention/flash-attn-4}" -- \
      "${FP8[@]}" --global-batch-size 64 --attention-backend flash
  bench fp8_flash_graphs_mb4 0 29740 170 --model reference --steps 20 --warmup 6 --label "${L_GRAPHS/cuDNN attention/flash-attn-4}, no per-micro-batch sync" -- \
      "${FP8[@]}" --global-batch-size 64 --attention-backend flash --cuda-graphs
  bench bf16_flash 0 29740 170 --model reference --steps 20 --warmup 6 --label "1 GPU, ZeRO-1, bf16, gbs 64, --torch-compile, pinned batches, flash-attn-4, no per-micro-batch sync" -- \
      --bf16 --deepspeed_config ds_configs/zero1.json --torch-compile --global-batch-size 64 --attention-backend flash
fi

if [ "$what" = fa_fp8_long ]; then  # as fa_fp8's graphed FP8 run, timed after 20 warm-up steps (it was still speeding up at 26)
  python3 -c "import flash_attn.cute" 2>/dev/null && echo "flash-attn-4 present" || { echo "NO flash-attn-4"; exit 1; }
  bench fp8_flash_graphs_mb4_long 0 29750 240 --model reference --steps 20 --warmup 20 --label "${L_GRAPHS/cuDNN attention/flash-attn-4}, no per-micro-batch sync" -- \
      "${FP8[@]}" --global-batch-size 64 --attention-backend flash --cuda-graphs
fi

if [ "$what" = checks ]; then  # this session's changes on a GPU: graph, TE, profile and DeepSpeed-config tests; FP8 mb 4 again
  CUDA_VISIBLE_DEVICES=0 timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_cuda_graphs.py tests/test_transformer_engine.py \
      tests/test_profiling.py tests/test_ds_config.py > "$OUT/logs/test_units.log" 2>&1
  echo "[test_units] rc=$? $(tail -1 "$OUT/logs/test_units.log")"; grep -h -E '^(E  |FAILED)' "$OUT/logs/test_units.log" | head -8
  gpu_tests test_gpu_graphs_fp16 0 330 "cuda_graphs or fp16_overflowing"
  bench fp8_mb4_again 0 29730 150 --model reference --steps 20 --warmup 6 --label "${L_GRAPHS/, --cuda-graphs/}, no per-micro-batch sync" -- \
      "${FP8[@]}" --global-batch-size 64
  bench fp8_mb4_gc 0 29730 150 --model reference --steps 20 --warmup 6 --label "${L_GRAPHS/, --cuda-graphs/}, no per-micro-batch sync, --manual-gc" -- \
      "${FP8[@]}" --global-batch-size 64 --manual-gc
fi

L_FUSED="$L_GRAPHS, no per-micro-batch sync, --gradient-accumulation-fusion"
if [ "$what" = fusion ]; then  # TE's GEMMs accumulating the weight gradients: tests, then with and without it
  CUDA_VISIBLE_DEVICES=0 timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_wgrad_fusion.py tests/test_cuda_graphs.py \
      > "$OUT/logs/test_fusion.log" 2>&1
  echo "[test_fusion] rc=$? $(tail -1 "$OUT/logs/test_fusion.log")"; grep -h -E '^(E  |FAILED)' "$OUT/logs/test_fusion.log" | head -8
  bench fp8_fused_graphs_mb4 0 29760 190 --model reference --steps 20 --warmup 6 --label "$L_FUSED" -- \
      "${FP8[@]}" --global-batch-size 64 --cuda-graphs --gradient-accumulation-fusion
  bench fp8_graphs_mb4 0 29760 190 --model reference --steps 20 --warmup 6 --label "$L_GRAPHS, no per-micro-batch sync" -- \
      "${FP8[@]}" --global-batch-size 64 --cuda-graphs
fi

if [ "$what" = fusion_more ]; then
  gpu_tests test_gpu_fusion 0 300 "gradient_accumulation_fusion"
  bench fp8_fused_mb4 0 29770 170 --model reference --steps 20 --warmup 6 --label "${L_FUSED/, --cuda-graphs/}" -- \
      "${FP8[@]}" --global-batch-size 64 --gradient-accumulation-fusion
  bench fp8_fused_graphs_mb4_prof 0 29770 170 --model reference --steps 14 --warmup 6 --label "$L_FUSED" -- \
      "${FP8[@]}" --global-batch-size 64 --cuda-graphs --gradient-accumulation-fusion --profile-step-range 10,11 --profile-dir "$OUT/prof/fused"
fi

if [ "$what" = fusion_tp2 ]; then
  gpu_tests test_gpu_te_tp2 0,1 560 "under_tp2"
fi

if [ "$what" = sidebyside ]; then
  bench ref_vs 0 29790 570 --model reference --steps 20 --warmup 6 --baselines torch,torch-compile,hf-zero2 \
      --label "1 GPU, ZeRO-1, bf16, gbs 64, --torch-compile, pinned batches, cuDNN attention, no per-micro-batch sync" -- \
      --bf16 --deepspeed_config ds_configs/zero1.json --torch-compile --global-batch-size 64 --attention-backend cudnn
fi

if [ "$what" = fa_fusion ]; then  # the call after `fa` on the same warm machine, .device restaged with ds te
  python3 -c "import flash_attn.cute" 2>/dev/null && echo "flash-attn-4 present" || { echo "NO flash-attn-4"; exit 1; }
  bench fp8_flash_fused_graphs_mb4 0 29780 260 --model reference --steps 20 --warmup 20 --label "${L_FUSED/cuDNN attention/flash-attn-4}" -- \
      "${FP8[@]}" --global-batch-size 64 --attention-backend flash --cuda-graphs --gradient-accumulation-fusion
  bench fp8_flash_graphs_mb4 0 29780 260 --model reference --steps 20 --warmup 20 --label "${L_GRAPHS/cuDNN attention/flash-attn-4}, no per-micro-batch sync" -- \
      "${FP8[@]}" --global-batch-size 64 --attention-backend flash --cuda-graphs
fi

find "$OUT/prof" -name 'trace_rank*.json' -delete 2>/dev/null
cat "$OUT"/rows_*.md > "$OUT/rows.md" 2>/dev/null
tar -czf "$OUT/logs.tar.gz" -C "$OUT" logs prof && rm -rf "$OUT/logs" "$OUT/prof" "$OUT"/rows_*.md
echo "--- rows"; cat "$OUT/rows.md" 2>/dev/null
