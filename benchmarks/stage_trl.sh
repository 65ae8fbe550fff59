#!/usr/bin/env bash
# Stage the wheels TRL's SFTTrainer and GRPOTrainer need on the GPU machine (it has transformers, accelerate, pandas,
# pyarrow, xxhash; not TRL, datasets, dill or multiprocess) into .device/trl/ (git-ignored), which
# .device/install.sh installs with the other bundles. Run after ../shared/device/stage.sh (which empties .device/):
#     ../shared/device/stage.sh ds && bash benchmarks/stage_trl.sh
set -euo pipefail
root=$(git rev-parse --show-toplevel)
exclude=$(git rev-parse --path-format=absolute --git-path info/exclude)  # also right in a worktree, where .git is a file
mkdir -p "$(dirname "$exclude")" && touch "$exclude"
grep -qxF /.device/ "$exclude" || echo /.device/ >> "$exclude"
mkdir -p "$root/.device/trl"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d "$root/.device/trl" trl==1.16.0 datasets==4.7.0 dill==0.4.0 multiprocess==0.70.18
du -sh "$root/.device/trl"
