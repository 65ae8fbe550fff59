#!/usr/bin/env bash
# Stage the wheels QLoRA needs on the GPU machine (no internet there): bitsandbytes (~43 MB, its CUDA 11.8-13.2 kernels in
# one wheel) for --quant-bits, and peft (~1 MB) for the PEFT peer of benchmarks/qlora_throughput.py, into .device/qlora/
# (git-ignored), which .device/install.sh installs with the other bundles. peft's other needs (accelerate, transformers,
# safetensors, psutil) are on that machine; the peer also needs TRL (benchmarks/stage_trl.sh). Run after
# ../shared/device/stage.sh (which empties .device/):
#     ../shared/device/stage.sh ds && bash benchmarks/stage_qlora.sh && bash benchmarks/stage_trl.sh
set -euo pipefail
root=$(git rev-parse --show-toplevel)
exclude=$(git rev-parse --path-format=absolute --git-path info/exclude)  # also right in a worktree, where .git is a file
mkdir -p "$(dirname "$exclude")" && touch "$exclude"
grep -qxF /.device/ "$exclude" || echo /.device/ >> "$exclude"
mkdir -p "$root/.device/qlora"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d "$root/.device/qlora" bitsandbytes==0.50.2 peft==0.21.2
du -sh "$root/.device/qlora"
